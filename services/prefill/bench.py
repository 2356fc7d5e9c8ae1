"""`tandem bench kv-transfer [--json FILE]`: KV transfer throughput over loopback, both paths.

Runs the real path end to end in one process: ``KvSender`` (the prefill worker's client)
sends a SmolLM2-shaped KV tensor (30 layers, 3 kv heads, head_dim 64, block 16, float32)
to a real gRPC server running ``DecodeWorkerServicer.KvTransfer`` into a ``KvReceiver``,
which validates and reassembles it, once as gRPC bytes and once through /dev/shm (the
same-host path: only the header goes over gRPC). GB/s = tensor bytes / (send start ->
the waiting future resolved); the buffer is then handed back as the decode worker does.
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
TRANSPORTS = ("grpc", "shm")


@dataclass
class _ReceiverOnly:
    """What DecodeWorkerServicer.KvTransfer needs of a worker (Generate is not benched)."""

    receiver: KvReceiver


async def _one(sender: KvSender, receiver: KvReceiver, address: str, rid: str, kv: torch.Tensor,
               transport: str, check: bool) -> float:
    """Seconds for one transfer (send start -> future resolved)."""
    shape = tuple(kv.shape)
    fut = receiver.expect(rid, ExpectedKv(0, shape[2], shape, kv.dtype))
    t0 = time.perf_counter()
    sent = await sender.send(address, rid, kv, 7, 0, shm=transport == "shm")
    got = await fut
    dt = time.perf_counter() - t0
    if not sent.ack.accepted or got.num_bytes != kv.numel() * kv.element_size():
        raise RuntimeError(f"transfer of {rid} failed: {sent.ack.error}")
    if sent.transport != transport:
        raise RuntimeError(f"transfer of {rid} went over {sent.transport}, not {transport}")
    if check and not torch.equal(got.kv, kv):
        raise RuntimeError(f"received KV differs from the sent KV ({transport})")
    got.release()  # as the decode worker does once the engine imported it
    return dt


async def _bench(token_counts: list[int], repeats: int, chunk_bytes: int) -> dict:
    import grpc

    receiver = KvReceiver()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_decode_servicer(DecodeWorkerServicer(_ReceiverOnly(receiver)), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    sender = KvSender("bench", chunk_bytes)
    by_tokens: dict[str, dict] = {}
    try:
        for n in token_counts:
            blocks = -(-n // BLOCK)
            kv = torch.randn(LAYERS, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM)  # (layers, 2, blocks, block, heads, dim)
            nbytes = kv.numel() * kv.element_size()
            entry: dict = {"bytes": nbytes}
            for transport in TRANSPORTS:
                # the first run warms the channel and the buffer pool up, and is checked bit-exact
                await _one(sender, receiver, address, f"b{n}-{transport}-w", kv, transport, True)
                rates = [nbytes / await _one(sender, receiver, address, f"b{n}-{transport}-{i}", kv,
                                             transport, False) / 1e9 for i in range(repeats)]
                entry[transport] = {"gb_s_median": round(statistics.median(rates), 3),
                                    "gb_s_min": round(min(rates), 3), "gb_s_max": round(max(rates), 3)}
            by_tokens[str(n)] = entry
    finally:
        await sender.close()
        await server.stop(grace=0)
    out: dict = {}
    total_b = sum(v["bytes"] for v in by_tokens.values())
    for transport in TRANSPORTS:
        # overall: byte-weighted harmonic mean of the medians (time-weighted throughput)
        total_t = sum(v["bytes"] / v[transport]["gb_s_median"] for v in by_tokens.values())
        out[f"{transport}_gb_s"] = round(total_b / total_t, 3)
    out.update({"by_tokens": by_tokens,
                "kv_shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                             "block_size": BLOCK, "dtype": "float32"},
                "chunk_bytes": chunk_bytes, "repeats": repeats})
    return out


def main(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.tokens.split(",") if x]
    if args.repeats < 1 or not counts:
        raise SystemExit("--repeats must be >= 1 and --tokens non-empty")
    result = asyncio.run(_bench(counts, args.repeats, args.chunk_bytes or PrefillConfig().kv_chunk_bytes))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    return 0
