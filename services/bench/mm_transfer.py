"""`tandem bench mm-transfer [--json FILE]`: image-embedding transfer GB/s over loopback gRPC.

The real transfer path: an ``EmbeddingReceiver`` (the worker that prefills) fetches one
image's embeddings from a real encode worker servicer (``EncodeWorkerServicer`` over an
``EmbeddingSender``) through ``GrpcEncodeChannel``. The encoder is replaced by a fixed
tensor of ``--rows`` x ``--hidden`` float32 (LLaVA-1.5-7B: 576 x 4096), so only the
transfer is timed. Each size runs twice: with a first buffer that holds the whole image
(no resume) and with ``--resume-blocks`` blocks (every fetch resumes, twice or more).
GB/s = embedding bytes / (fetch start -> the concatenated tensor back).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import time

import grpc
import torch

from services.bench.results import finish, header, write_json
from services.encode.client import CHANNEL_OPTIONS, GrpcEncodeChannel
from services.encode.grpc_server import serve_encode_worker
from services.engine.multimodal.blocks import EmbeddingBlockAllocator
from services.engine.multimodal.buffers import EmbeddingBuffers
from services.engine.multimodal.embedder import LocalEncodeChannel
from services.engine.multimodal.transfer import EmbeddingReceiver, EmbeddingSender
from services.gen import encode_pb2_grpc

BLOCK = 128


async def _bench(rows_list: list[int], hidden: int, repeats: int, resume_blocks: int) -> dict:
    most = max(rows_list)
    num_blocks = 2 * -(-most // BLOCK) + 2
    images = {n: torch.randn(n, hidden) for n in rows_list}
    sender = EmbeddingSender(EmbeddingBlockAllocator(num_blocks, BLOCK, 1),
                             EmbeddingBuffers(num_blocks, BLOCK, hidden),
                             lambda h, data: images[int(data.decode())])
    local = LocalEncodeChannel(sender, "bench")
    server, port = await serve_encode_worker(local, "127.0.0.1", 0)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    channel = GrpcEncodeChannel(f"127.0.0.1:{port}", encode_pb2_grpc.EncodeWorkerStub(ch), "bench")
    by_rows: dict[str, dict] = {}
    seconds: dict[str, float] = {"no_resume": 0.0, "resume": 0.0}  # sum of median times, per mode
    try:
        for n in rows_list:
            nbytes = n * hidden * 4
            entry: dict = {"bytes": nbytes}
            whole = -(-n // BLOCK)
            for mode, default_blocks in (("no_resume", whole), ("resume", min(resume_blocks, whole))):
                receiver = EmbeddingReceiver(EmbeddingBlockAllocator(num_blocks, BLOCK, default_blocks),
                                             EmbeddingBuffers(num_blocks, BLOCK, hidden))
                image = str(n).encode()
                digest = hashlib.sha256(image).hexdigest()
                got = await receiver.fetch(f"w{n}{mode}", digest, image, [channel])
                if not torch.equal(got, images[n]):
                    raise RuntimeError("received embeddings differ from the sent ones")
                rates = []
                for i in range(repeats):
                    t0 = time.perf_counter()
                    await receiver.fetch(f"r{n}{mode}{i}", digest, image, [channel])
                    rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
                if receiver.allocator.used_blocks or sender.allocator.used_blocks:
                    raise RuntimeError("embedding blocks left held after the transfers")
                seconds[mode] += nbytes / 1e9 / statistics.median(rates)
                entry[mode] = {"gb_s_median": round(statistics.median(rates), 3),
                               "gb_s_min": round(min(rates), 3), "gb_s_max": round(max(rates), 3),
                               "first_buffer_rows": default_blocks * BLOCK}
            by_rows[str(n)] = entry
    finally:
        await ch.close()
        await server.stop(grace=0)
        local.close()
    out: dict = {}
    total_b = sum(v["bytes"] for v in by_rows.values())
    for mode, t in seconds.items():
        # overall: byte-weighted harmonic mean of the medians (time-weighted throughput)
        out[f"{mode}_gb_s"] = round(total_b / 1e9 / t, 4)
    out.update({"by_rows": by_rows, "hidden": hidden, "dtype": "float32", "block_size": BLOCK,
                "resume_blocks": resume_blocks, "repeats": repeats})
    return out


def main(args: argparse.Namespace) -> int:
    rows = [int(x) for x in args.rows.split(",") if x]
    if args.repeats < 1 or not rows or min(rows) < 1 or args.hidden < 1 or args.resume_blocks < 1:
        raise SystemExit("--repeats, --hidden, --resume-blocks must be >= 1 and --rows non-empty positive")
    head = header(args)
    result = finish(head, asyncio.run(_bench(rows, args.hidden, args.repeats, args.resume_blocks)))
    print(json.dumps(result, indent=2))
    write_json(args.json_path, result)
    return 0
