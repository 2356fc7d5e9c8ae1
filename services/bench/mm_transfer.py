"""`tandem bench mm-transfer [--json FILE]`: image-embedding transfer GB/s over loopback,
gRPC bytes and /dev/shm, beside a plain memory copy of the same bytes.

The real transfer path: an ``EmbeddingReceiver`` (the worker that prefills) fetches one
image's embeddings from a real encode worker servicer (``EncodeWorkerServicer`` over an
``EmbeddingSender`` with a ``ShmPlacer``) through ``GrpcEncodeChannel``: once with no
shared memory (rows as gRPC bytes) and once with the channel's segment pool (the encode
side writes the rows into the receiver's segment; only headers cross gRPC). The encoder is
replaced by a fixed tensor of ``--rows`` x ``--hidden`` in ``--dtype`` (LLaVA-1.5-7B: 576
x 4096), so only the transfer is timed. Each size and path runs twice: with a first buffer
that holds the whole image (no resume) and with ``--resume-blocks`` blocks (every fetch
resumes, twice or more). GB/s = embedding bytes / (fetch start -> the image's tensor
back). ``memcpy`` = the same bytes copied by ``Tensor.copy_`` into a preallocated tensor.
The encode worker runs in a child process (``--processes 2``, as deployed) or in this one.
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

from services.bench.kv_transfer import _memcpy_seconds
from services.bench.results import finish, header, write_json
from services.common.malloc_tuning import tune_malloc
from services.disagg.kv_wire import dtype_from_name
from services.encode.client import CHANNEL_OPTIONS, GrpcEncodeChannel
from services.encode.grpc_server import serve_encode_worker
from services.engine.multimodal.blocks import EmbeddingBlockAllocator
from services.engine.multimodal.buffers import EmbeddingBuffers
from services.engine.multimodal.embedder import LocalEncodeChannel
from services.engine.multimodal.placer import ShmPlacer
from services.engine.multimodal.transfer import EmbeddingReceiver, EmbeddingSender

BLOCK = 128
# result key -> (transport, resume)
MODES = {"no_resume": ("grpc", False), "resume": ("grpc", True),
         "shm": ("shm", False), "shm_resume": ("shm", True)}


def _stats(rates: list[float]) -> dict:
    return {"gb_s_median": round(statistics.median(rates), 3), "gb_s_min": round(min(rates), 3),
            "gb_s_max": round(max(rates), 3)}


def _images(rows_list: list[int], hidden: int, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """The fixed "encoder output" of each size (seeded: both processes make the same)."""
    return {n: torch.randn(n, hidden, generator=torch.Generator().manual_seed(n)).to(dtype) for n in rows_list}


class _EncodeEnd:
    """The encode worker: a real servicer over an EmbeddingSender whose encoder returns the
    fixed tensors; ``used_blocks()`` is its allocator's count after the transfers."""

    def __init__(self, rows_list: list[int], hidden: int, dtype: torch.dtype) -> None:
        images = _images(rows_list, hidden, dtype)
        num_blocks = 2 * -(-max(rows_list) // BLOCK) + 2
        self.sender = EmbeddingSender(EmbeddingBlockAllocator(num_blocks, BLOCK, 1),
                                      EmbeddingBuffers(num_blocks, BLOCK, hidden, dtype),
                                      lambda h, data: images[int(data.decode())], placer=ShmPlacer(4 << 30))
        self.local = LocalEncodeChannel(self.sender, "bench")

    async def start(self) -> int:
        self.server, port = await serve_encode_worker(self.local, "127.0.0.1", 0)
        return port

    async def stop(self) -> int:
        await self.server.stop(grace=0)
        self.local.close()
        return self.sender.allocator.used_blocks


def _child_main(conn, rows_list: list[int], hidden: int, dtype: torch.dtype) -> None:
    tune_malloc()  # a spawned process, not the CLI: as the encode worker's process is

    async def run() -> None:
        end = _EncodeEnd(rows_list, hidden, dtype)
        conn.send(await end.start())
        await asyncio.to_thread(conn.recv)  # "stop"
        conn.send(await end.stop())

    asyncio.run(run())


async def _bench(rows_list: list[int], hidden: int, repeats: int, resume_blocks: int,
                 dtype: torch.dtype = torch.float32, processes: int = 1) -> dict:
    most = max(rows_list)
    num_blocks = 2 * -(-most // BLOCK) + 2
    images = _images(rows_list, hidden, dtype)
    child = conn = local_end = None
    if processes == 2:
        import multiprocessing as mp

        conn, child_conn = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(target=_child_main, args=(child_conn, rows_list, hidden, dtype),
                                                daemon=True)
        child.start()
        port = await asyncio.to_thread(conn.recv)
    else:
        local_end = _EncodeEnd(rows_list, hidden, dtype)
        port = await local_end.start()
    address = f"127.0.0.1:{port}"
    ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    channels = {"grpc": GrpcEncodeChannel(address, ch, "bench"),
                "shm": GrpcEncodeChannel(address, ch, "bench-shm", shm_pool_bytes=4 << 30)}
    by_rows: dict[str, dict] = {}
    seconds: dict[str, float] = {mode: 0.0 for mode in (*MODES, "memcpy")}  # sums of median times
    try:
        for n in rows_list:
            nbytes = n * hidden * images[n].element_size()
            entry: dict = {"bytes": nbytes}
            rates = [nbytes / t / 1e9 for t in _memcpy_seconds(images[n], repeats)]
            entry["memcpy"] = _stats(rates)
            seconds["memcpy"] += nbytes / 1e9 / statistics.median(rates)
            whole = -(-n // BLOCK)
            for mode, (transport, resume) in MODES.items():
                default_blocks = min(resume_blocks, whole) if resume else whole
                receiver = EmbeddingReceiver(EmbeddingBlockAllocator(num_blocks, BLOCK, default_blocks),
                                             EmbeddingBuffers(num_blocks, BLOCK, hidden, dtype))
                channel = channels[transport]
                image = str(n).encode()
                digest = hashlib.sha256(image).hexdigest()
                # the first fetch warms the path (and the segments) up, and is checked bit-exact
                got = await receiver.fetch(f"w{n}{mode}", digest, image, [channel])
                if not torch.equal(got, images[n]):
                    raise RuntimeError("received embeddings differ from the sent ones")
                if transport == "shm" and channel.shm_declined:
                    raise RuntimeError("the encode side did not take the shared-memory segment")
                del got  # as the engine drops an image once prefilled: its segment is free again
                rates = []
                for i in range(repeats):
                    t0 = time.perf_counter()
                    await receiver.fetch(f"r{n}{mode}{i}", digest, image, [channel])
                    rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
                if receiver.allocator.used_blocks:
                    raise RuntimeError("embedding blocks left held after the transfers")
                seconds[mode] += nbytes / 1e9 / statistics.median(rates)
                entry[mode] = {**_stats(rates), "first_buffer_rows": default_blocks * BLOCK}
            by_rows[str(n)] = entry
    finally:
        for c in channels.values():
            c.close()
        await ch.close()
        if local_end is not None:
            held = await local_end.stop()
        else:
            conn.send("stop")
            held = await asyncio.to_thread(conn.recv)
            child.join(timeout=10)
    if held:
        raise RuntimeError(f"the encode side holds {held} embedding blocks after the transfers")
    out: dict = {}
    total_b = sum(v["bytes"] for v in by_rows.values())
    for mode, t in seconds.items():
        # overall: byte-weighted harmonic mean of the medians (time-weighted throughput)
        out[f"{mode}_gb_s"] = round(total_b / 1e9 / t, 4)
    out.update({"by_rows": by_rows, "hidden": hidden, "dtype": str(dtype).removeprefix("torch."),
                "block_size": BLOCK, "resume_blocks": resume_blocks, "repeats": repeats,
                "processes": processes})
    return out


def main(args: argparse.Namespace) -> int:
    rows = [int(x) for x in args.rows.split(",") if x]
    if args.repeats < 1 or not rows or min(rows) < 1 or args.hidden < 1 or args.resume_blocks < 1:
        raise SystemExit("--repeats, --hidden, --resume-blocks must be >= 1 and --rows non-empty positive")
    head = header(args)
    if args.processes not in (1, 2):
        raise SystemExit("--processes must be 1 or 2")
    result = finish(head, asyncio.run(_bench(rows, args.hidden, args.repeats, args.resume_blocks,
                                             dtype_from_name(args.dtype), args.processes)))
    print(json.dumps(result, indent=2))
    write_json(args.json_path, result)
    return 0
