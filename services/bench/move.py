"""`tandem bench move [-c FILE] [--set k=v] [--json FILE]`: the gap a draining decode worker
adds to its streams, moving them (KV pulled by the target) against the replay fallback.

In one process: a router, a processor and decode workers on real gRPC over loopback (the
engine of ``-c``: mock or torch). Each trial starts ``--streams`` greedy streams of distinct
random ``--prompt-len``-token prompts on a fresh worker; once each produced ``--after``
tokens the other worker joins and the first leaves the router, then

- ``move``: the first drains (``decode.drain: move``, as on SIGTERM);
- ``replay``: its gRPC server stops at once (as a SIGKILL): the processor replays each
  stream on the other worker (prompt + produced tokens prefilled again).

A stream's gap is the longest time between two of its tokens from that moment on (client
side, through the processor): the one across the move; its ITL is the median gap before. Prompts
differ per stream and trial, so no replay hits the other worker's prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import grpc

from services.api.processor import ProcessRequest
from services.api.sampling import SamplingParams
from services.bench.results import finish, header, write_json
from services.common.address_book import ChannelPool
from services.common.config import ClusterConfig, load_config
from services.common.discovery import Registration
from services.decode.grpc_server import serve_decode_worker
from services.decode.worker import DecodeWorker
from services.engine.async_engine import AsyncEngine
from services.engine.factory import build_engine
from services.model.store import resolve_model_path
from services.model.tokenizer import Tokenizer
from services.processor.processor import Processor
from services.processor.worker_client import DecodeWorkerClient
from services.router.router import Router

MODES = ("move", "replay")


@dataclass
class _Node:
    worker: DecodeWorker
    server: grpc.aio.Server
    address: str


@asynccontextmanager
async def _node(cfg: ClusterConfig, worker_id: str) -> AsyncIterator[_Node]:
    async with AsyncEngine(build_engine(cfg, worker_id=worker_id).engine) as ae:
        worker = DecodeWorker(ae, cfg, worker_id)
        server, port = await serve_decode_worker(worker, "127.0.0.1", 0)
        worker.kv_address = f"127.0.0.1:{port}"
        try:
            yield _Node(worker, server, worker.kv_address)
        finally:
            await server.stop(grace=0)
            await worker.close()


async def _stream(p: Processor, req: ProcessRequest, after: int, reached: asyncio.Event,
                  counter: list[int]) -> list[float]:
    """Each delta's arrival time; ``counter[0]`` counts the streams past ``after``."""
    times: list[float] = []
    async for _ in p.generate(req):
        times.append(time.perf_counter())
        if len(times) == after:
            counter[0] -= 1
            if counter[0] == 0:
                reached.set()
    return times


async def _trial(cfg: ClusterConfig, p: Processor, router: Router, dst: _Node, mode: str,
                 trial: int, args: argparse.Namespace, vocab: int) -> list[dict[str, float]]:
    rng = random.Random(f"{mode}-{trial}")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    reached, left = asyncio.Event(), [args.streams]
    async with _node(cfg, f"src-{mode}-{trial}") as src:
        router.worker_joined(Registration("decode", src.worker.worker_id, address=src.address))
        tasks = [asyncio.create_task(_stream(p, ProcessRequest(
            f"{mode}-{trial}-{i}", prompt_ids=tuple(rng.randrange(100, vocab) for _ in range(args.prompt_len)),
            model=cfg.model.name, sampling=sp), args.after, reached, left)) for i in range(args.streams)]
        await asyncio.wait_for(reached.wait(), args.timeout)
        t_move = time.perf_counter()
        router.worker_joined(Registration("decode", dst.worker.worker_id, address=dst.address))
        router.worker_left(src.worker.worker_id)
        if mode == "move":
            await src.worker.drain(args.timeout)
        else:
            await src.server.stop(grace=0)
        streams = await asyncio.wait_for(asyncio.gather(*tasks), args.timeout)
    router.worker_left(dst.worker.worker_id)
    out = []
    for times in streams:
        pairs = list(zip(times, times[1:], strict=False))
        itl = statistics.median(b - a for a, b in pairs if b <= t_move)
        # NOTE: the worker may stream a token or two after t_move before it holds the
        # request: the move is the longest gap from then on.
        out.append({"gap_s": max(b - a for a, b in pairs if b > t_move), "itl_s": itl,
                    "tokens": len(times)})
    return out


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _bench(cfg: ClusterConfig, args: argparse.Namespace) -> dict:
    tok = Tokenizer.from_path(resolve_model_path(cfg.model.path))
    vocab = min(tok.vocab_size, 20000)
    result: dict[str, object] = {"runner": cfg.engine.runner, "prompt_len": args.prompt_len,
                                 "streams": args.streams, "trials": args.trials,
                                 "after": args.after, "max_tokens": args.max_tokens}
    pool = ChannelPool()
    async with AsyncExitStack() as stack:
        router = Router(cfg)
        p = Processor(tok, router, DecodeWorkerClient(pool), cfg.model.name,
                      cfg.engine.max_model_len or 2048, cfg.engine.block_size)
        for mode in args.modes.split(","):
            dst = await stack.enter_async_context(_node(cfg, f"dst-{mode}"))
            rows: list[dict[str, float]] = []
            for trial in range(args.trials):
                rows += await _trial(cfg, p, router, dst, mode, trial, args, vocab)
            gaps = [r["gap_s"] for r in rows]
            itls = [r["itl_s"] for r in rows]
            result[mode] = {"n": len(rows), "gap_p50_s": _q(gaps, 0.5), "gap_p99_s": _q(gaps, 0.99),
                            "gap_max_s": max(gaps), "itl_p50_s": _q(itls, 0.5),
                            "gaps_s": [round(g, 5) for g in gaps]}
            print(f"{mode}: {len(rows)} streams, gap p50 {result[mode]['gap_p50_s'] * 1e3:.1f} ms, "
                  f"p99 {result[mode]['gap_p99_s'] * 1e3:.1f} ms (ITL p50 "
                  f"{result[mode]['itl_p50_s'] * 1e3:.1f} ms)", flush=True)
    await pool.close()
    return result


def main(args: argparse.Namespace) -> int:
    if not set(args.modes.split(",")) <= set(MODES) or args.after < 2 or args.streams < 1:
        raise SystemExit(f"--modes from {MODES}, --after >= 2, --streams >= 1")
    cfg = load_config(args.config, args.overrides)
    head = header(args)
    result = finish(head, asyncio.run(_bench(cfg, args)))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    write_json(args.json_path, result)
    return 0
