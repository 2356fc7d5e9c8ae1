"""`tandem bench kv-transfer [--json FILE]`: KV transfer throughput over loopback, both
paths, beside a plain memory copy of the same bytes.

Runs the real path end to end on this host: ``KvSender`` (the prefill worker's client)
sends a SmolLM2-shaped KV tensor (30 layers, 3 kv heads, head_dim 64, block 16, in
``--dtype``) to a real gRPC server running ``DecodeWorkerServicer.KvTransfer`` into a
``KvReceiver``, which validates and reassembles it, once as gRPC bytes and once through
/dev/shm (the same-host path: only the header goes over gRPC; the sender's reusable
segment, warmed by the checked first transfer). GB/s = tensor bytes / (send start -> the
waiting future resolved); the buffer (or segment) is then handed back as the decode worker
does. ``memcpy`` = the same bytes copied by ``Tensor.copy_`` into a preallocated tensor in
this process, timed the same way: the ceiling on this machine at that moment. The decode
end runs in a child process (``--processes 2``, as deployed) or in this one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import torch

from services.bench.results import finish, header, write_json
from services.common.config import PrefillConfig
from services.common.grpc_server import serve_grpc
from services.common.malloc_tuning import tune_malloc
from services.decode.grpc_server import SERVER_OPTIONS, DecodeWorkerServicer, add_decode_servicer
from services.decode.kv_receiver import ExpectedKv, KvReceiver
from services.disagg.kv_wire import dtype_from_name
from services.disagg.transfer_token import new_token
from services.prefill.kv_sender import KvSender

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
TRANSPORTS = ("grpc", "shm")
COLUMNS = (*TRANSPORTS, "memcpy")


@dataclass
class _ReceiverOnly:
    """What DecodeWorkerServicer.KvTransfer needs of a worker (Generate is not benched)."""

    receiver: KvReceiver


class _LocalEnd:
    """The receiving end in this process: ``expect`` registers with the real receiver."""

    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver
        self._futs: dict[str, asyncio.Future] = {}

    async def expect(self, rid: str, shape: tuple[int, ...], dtype: torch.dtype, token: bytes) -> None:
        self._futs[rid] = self.receiver.expect(rid, ExpectedKv(0, shape[2], shape, dtype, token))

    async def done(self, rid: str, kv: torch.Tensor | None) -> None:
        got = await self._futs.pop(rid)
        if kv is not None and not torch.equal(got.kv, kv):
            raise RuntimeError("received KV differs from the sent KV")
        got.release()  # as the decode worker does once the engine imported it


class _ChildEnd:
    """The receiving end in a child process (as in a deployment: prefill and decode are
    separate processes); ``expect`` goes over a pipe before each transfer."""

    def __init__(self, conn) -> None:
        self._conn = conn

    async def expect(self, rid: str, shape: tuple[int, ...], dtype: torch.dtype, token: bytes) -> None:
        self._conn.send(("expect", rid, shape, dtype, token))
        await asyncio.to_thread(self._conn.recv)

    async def done(self, rid: str, kv: torch.Tensor | None) -> None:
        self._conn.send(("check", rid, kv))  # the child awaited the future before the ack
        ok = await asyncio.to_thread(self._conn.recv)
        if ok is not True:
            raise RuntimeError(f"child receiver: {ok}")


async def _one(sender: KvSender, end, address: str, rid: str, kv: torch.Tensor,
               transport: str, check: bool) -> float:
    """Seconds for one transfer (send start -> the decode side's ack, which is sent once the
    waiting future resolved)."""
    nbytes = kv.numel() * kv.element_size()
    token = new_token()
    await end.expect(rid, tuple(kv.shape), kv.dtype, token)
    t0 = time.perf_counter()
    sent = await sender.send(address, rid, kv, 7, 0, shm=transport == "shm", token=token)
    dt = time.perf_counter() - t0
    if not sent.ack.accepted or sent.ack.bytes_received != nbytes:
        raise RuntimeError(f"transfer of {rid} failed: {sent.ack.error}")
    if sent.transport != transport:
        raise RuntimeError(f"transfer of {rid} went over {sent.transport}, not {transport}")
    await end.done(rid, kv if check else None)
    return dt


async def _serve(receiver: KvReceiver):
    servicer = DecodeWorkerServicer(_ReceiverOnly(receiver))  # type: ignore[arg-type]
    return await serve_grpc("kv-transfer bench", "127.0.0.1", 0,
                            lambda s: add_decode_servicer(servicer, s), options=SERVER_OPTIONS)


def _child_main(conn) -> None:
    tune_malloc()  # a spawned process, not the CLI: as the decode worker's process is
    torch.set_num_threads(1)

    async def run() -> None:
        receiver = KvReceiver()
        server, port = await _serve(receiver)
        conn.send(port)
        futs: dict[str, asyncio.Future] = {}
        while True:
            msg = await asyncio.to_thread(conn.recv)
            if msg[0] == "expect":
                futs[msg[1]] = receiver.expect(
                    msg[1], ExpectedKv(0, msg[2][2], msg[2], msg[3], msg[4]))
                conn.send(True)
            elif msg[0] == "check":
                got = await futs.pop(msg[1])
                ok = msg[2] is None or torch.equal(got.kv, msg[2])
                got.release()
                conn.send(True if ok else "received KV differs from the sent KV")
            else:
                await server.stop(grace=0)
                return

    asyncio.run(run())


def _memcpy_seconds(src: torch.Tensor, repeats: int) -> list[float]:
    """Seconds of ``repeats`` copies of ``src`` into one preallocated tensor (warmed first)."""
    dst = torch.empty_like(src)
    dst.copy_(src)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t0)
    return out


async def _bench(token_counts: list[int], repeats: int, chunk_bytes: int, processes: int,
                 dtype: torch.dtype = torch.float32) -> dict:
    child = conn = server = None
    if processes == 2:
        import multiprocessing as mp

        conn, child_conn = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(target=_child_main, args=(child_conn,), daemon=True)
        child.start()
        port = await asyncio.to_thread(conn.recv)
        end: _LocalEnd | _ChildEnd = _ChildEnd(conn)
    else:
        receiver = KvReceiver()
        server, port = await _serve(receiver)
        end = _LocalEnd(receiver)
    address = f"127.0.0.1:{port}"
    sender = KvSender("bench", chunk_bytes)
    by_tokens: dict[str, dict] = {}
    try:
        for n in token_counts:
            blocks = -(-n // BLOCK)
            # (layers, 2, blocks, block, heads, dim)
            kv = torch.randn(LAYERS, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
            nbytes = kv.numel() * kv.element_size()
            entry: dict = {"bytes": nbytes}
            rates = [nbytes / t / 1e9 for t in _memcpy_seconds(kv, repeats)]
            entry["memcpy"] = {"gb_s_median": round(statistics.median(rates), 3),
                               "gb_s_min": round(min(rates), 3), "gb_s_max": round(max(rates), 3)}
            for transport in TRANSPORTS:
                # the first run warms the channel and the buffer pool up, and is checked bit-exact
                await _one(sender, end, address, f"b{n}-{transport}-w", kv, transport, True)
                rates = [nbytes / await _one(sender, end, address, f"b{n}-{transport}-{i}", kv,
                                             transport, False) / 1e9 for i in range(repeats)]
                entry[transport] = {"gb_s_median": round(statistics.median(rates), 3),
                                    "gb_s_min": round(min(rates), 3), "gb_s_max": round(max(rates), 3)}
            by_tokens[str(n)] = entry
    finally:
        await sender.close()
        if server is not None:
            await server.stop(grace=0)
        if conn is not None and child is not None:
            conn.send(("stop",))
            child.join(timeout=10)
    out: dict = {}
    total_b = sum(v["bytes"] for v in by_tokens.values())
    for transport in COLUMNS:
        # overall: byte-weighted harmonic mean of the medians (time-weighted throughput)
        total_t = sum(v["bytes"] / v[transport]["gb_s_median"] for v in by_tokens.values())
        out[f"{transport}_gb_s"] = round(total_b / total_t, 3)
    out.update({"by_tokens": by_tokens,
                "kv_shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                             "block_size": BLOCK, "dtype": str(dtype).removeprefix("torch.")},
                "chunk_bytes": chunk_bytes, "repeats": repeats, "processes": processes})
    return out


def main(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.tokens.split(",") if x]
    if args.repeats < 1 or not counts or args.processes not in (1, 2):
        raise SystemExit("--repeats must be >= 1, --tokens non-empty, --processes 1 or 2")
    head = header(args)
    result = asyncio.run(_bench(counts, args.repeats, args.chunk_bytes or PrefillConfig().kv_chunk_bytes,
                                args.processes, dtype_from_name(args.dtype)))
    result = finish(head, result)
    print(json.dumps(result, indent=2))
    write_json(args.json_path, result)
    return 0
