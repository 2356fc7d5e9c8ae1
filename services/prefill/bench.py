"""`tandem bench kv-transfer [--json FILE]`: KV transfer throughput over loopback gRPC.

Runs the real path end to end in one process: ``KvSender`` (the prefill worker's client)
streams a SmolLM2-shaped KV tensor (30 layers, 3 kv heads, head_dim 64, block 16, float32)
to a real gRPC server running ``DecodeWorkerServicer.KvTransfer`` into a ``KvReceiver``,
which validates and reassembles it. GB/s = tensor bytes / (send start -> future resolved).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import torch

from services.common.config import PrefillConfig
from services.decode.grpc_server import SERVER_OPTIONS, DecodeWorkerServicer, add_decode_servicer
from services.decode.kv_receiver import ExpectedKv, KvReceiver
from services.prefill.kv_sender import KvSender

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


@dataclass
class _ReceiverOnly:
    """What DecodeWorkerServicer.KvTransfer needs of a worker (Generate is not benched)."""

    receiver: KvReceiver


async def _bench(token_counts: list[int], repeats: int, chunk_bytes: int) -> dict:
    import grpc

    receiver = KvReceiver()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_decode_servicer(DecodeWorkerServicer(_ReceiverOnly(receiver)), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sender = KvSender("bench", chunk_bytes)
    by_tokens: dict[str, dict] = {}
    try:
        for n in token_counts:
            blocks = -(-n // BLOCK)
            shape = (LAYERS, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM)
            kv = torch.randn(shape, dtype=torch.float32)  # (layers, 2, blocks, block, heads, dim)
            nbytes = kv.numel() * kv.element_size()
            rates = []
            for i in range(repeats + 1):  # the first run warms the channel up
                rid = f"b{n}-{i}"
                fut = receiver.expect(rid, ExpectedKv(0, blocks, shape, torch.float32))
                t0 = time.perf_counter()
                ack = await sender.send(f"127.0.0.1:{port}", rid, kv, 7, 0)
                got = await fut
                dt = time.perf_counter() - t0
                release = got.release  # as the decode worker does once imported
                if not ack.accepted or got.num_bytes != nbytes:
                    raise RuntimeError(f"transfer of {rid} failed: {ack.error}")
                if i == 0:
                    if not torch.equal(got.kv, kv):
                        raise RuntimeError("received KV differs from the sent KV")
                    release()
                    continue
                release()
                rates.append(nbytes / dt / 1e9)
            by_tokens[str(n)] = {"bytes": nbytes, "gb_s_median": round(statistics.median(rates), 3),
                                 "gb_s_min": round(min(rates), 3)}
    finally:
        await sender.close()
        await server.stop(grace=0)
    total_b = sum(v["bytes"] for v in by_tokens.values())
    # overall: byte-weighted harmonic mean of the medians (time-weighted throughput)
    total_t = sum(v["bytes"] / v["gb_s_median"] for v in by_tokens.values())
    return {"grpc_gb_s": round(total_b / total_t, 3), "by_tokens": by_tokens,
            "kv_shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                         "block_size": BLOCK, "dtype": "float32"},
            "chunk_bytes": chunk_bytes, "repeats": repeats}


def main(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.tokens.split(",") if x]
    result = asyncio.run(_bench(counts, args.repeats, args.chunk_bytes or PrefillConfig().kv_chunk_bytes))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    return 0
