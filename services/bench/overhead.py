"""`tandem bench overhead`: the stack's overhead on a short prompt, as time to first token
at each layer, from the inside out.

Against a cluster (a running one at ``--base-url``, or one started from the config with
``--up``), ``--n`` sequential requests (after ``--warmup``) of a ``--prompt-len``-token
prompt, max_tokens 1, unique prompts so no prefix hits, timed at each layer:

- engine:   an in-process ``AsyncEngine`` built from the same config (no network)
- decode:   the decode worker's gRPC ``Generate`` to its first response
- router:   the router's gRPC ``Route`` round trip (then ``Update FINISHED``)
- processor: the processor's gRPC ``Generate`` (route + decode + detokenize) to its
  first message
- http:     the whole path: HTTP -> frontend -> processor -> router + decode -> SSE, from
  an httpx client (as ``tandem bench serve`` sends)
- http_raw: the same from a minimal hand-written HTTP/1.1 client (the stack's share)

Medians, p90s and means in ms. ``--cpu-per-request`` also reads every cluster process's
user+system CPU time (/proc/PID/stat) before and after each layer's measured requests
(warm-up excluded) and divides by ``--n``: where the stack spends its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import torch

from services.api.processor import ProcessRequest
from services.api.processor_codec import request_to_pb
from services.api.sampling import SamplingParams
from services.api.worker_codec import generate_request_to_pb
from services.bench.args import OVERHEAD_LAYERS
from services.bench.client import RequestRecord, send
from services.bench.cluster import cluster_if_asked, cluster_processes
from services.bench.results import finish, header, write_json
from services.bench.workloads import ID_HIGH, ID_LOW
from services.common.config import ClusterConfig, load_config
from services.common.grpc_auth import call_metadata
from services.common.service import event_loop_factory
from services.engine.async_engine import AsyncEngine
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest
from services.gen import (
    processor_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2_grpc,
)
from services.launcher.up import served_name


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(ID_LOW, ID_HIGH, size=length).tolist() for _ in range(n)]


def _stats(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "mean": float(a.mean()), "n": len(a)}


async def _first_item_ms(start: Callable[[], AsyncIterator[object]]) -> float:
    """Milliseconds from starting the stream to its first item; the rest is drained (each
    layer is asked for one token) so the call ends before the next request."""
    t0 = time.perf_counter()
    first = None
    async for _ in start():
        if first is None:
            first = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream ended without an item")
    return (first - t0) * 1000


async def engine_ttft(cfg: ClusterConfig, prompts: list[list[int]]) -> list[float]:
    parts = build_engine(cfg, worker_id="overhead")
    out = []
    async with AsyncEngine(parts.engine) as ae:
        for i, p in enumerate(prompts):
            req = GenerateRequest(f"e{i}", p, SamplingParams(temperature=0.0, max_tokens=1))
            out.append(await _first_item_ms(partial(ae.generate, req)))
    return out


_ONE_GREEDY_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


async def decode_ttft(address: str, prompts: list[list[int]]) -> list[float]:
    out = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        for i, p in enumerate(prompts):
            req = generate_request_to_pb(f"d{i}-{time.time_ns()}", p, _ONE_GREEDY_TOKEN)
            out.append(await _first_item_ms(partial(stub.Generate, req, metadata=call_metadata())))
    return out


async def router_rtt(address: str, prompts: list[list[int]]) -> list[float]:
    out = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        for i, p in enumerate(prompts):
            rid = f"r{i}-{time.time_ns()}"
            t0 = time.perf_counter()
            await stub.Route(router_pb2.RouteRequest(request_id=rid, token_ids=p),
                             metadata=call_metadata())
            out.append((time.perf_counter() - t0) * 1000)
            await stub.Update(router_pb2.RequestUpdate(
                request_id=rid, phase=router_pb2.RequestUpdate.FINISHED), metadata=call_metadata())
    return out


async def processor_ttft(address: str, prompts: list[list[int]]) -> list[float]:
    out = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = processor_pb2_grpc.ProcessorStub(ch)
        for i, p in enumerate(prompts):
            req = request_to_pb(ProcessRequest(f"p{i}-{time.time_ns()}", prompt_ids=tuple(p),
                                               sampling=_ONE_GREEDY_TOKEN))
            out.append(await _first_item_ms(partial(stub.Generate, req, metadata=call_metadata())))
    return out


async def http_ttft(base_url: str, model: str, prompts: list[list[int]]) -> list[float]:
    import httpx

    out = []
    url = base_url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient() as client:
        for i, p in enumerate(prompts):
            rec = RequestRecord(i, len(p))
            body = {"model": model, "prompt": p, "max_tokens": 1, "temperature": 0.0,
                    "stream": True}
            await send(client, url, body, rec, 60.0)
            if not rec.ok:
                raise RuntimeError(f"request {i} failed: {rec.error}")
            out.append((rec.first_token_time - rec.send_time) * 1000)
    return out


async def http_raw_ttft(base_url: str, model: str, prompts: list[list[int]]) -> list[float]:
    """The same request as ``http_ttft`` from a minimal client: one kept-alive socket, the
    request written by hand, the clock stopped at the first SSE event carrying text. What
    httpx adds on the client side (~1 ms a request here) is left out, so this layer is the
    server stack's share of the time to first token."""
    from urllib.parse import urlsplit

    u = urlsplit(base_url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    reader, writer = await asyncio.open_connection(host, port)
    out = []
    try:
        for p in prompts:
            body = json.dumps({"model": model, "prompt": p, "max_tokens": 1, "temperature": 0.0,
                               "stream": True}).encode()
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
            t0 = time.perf_counter()
            writer.write(head.encode() + body)
            buf = b""
            first = None
            while b"data: [DONE]" not in buf or not buf.endswith(b"0\r\n\r\n"):
                data = await reader.read(65536)
                if not data:
                    raise RuntimeError("the server closed the connection")
                buf += data
                if first is None and b'"text":' in buf:
                    first = time.perf_counter()
            if not buf.startswith(b"HTTP/1.1 200") or first is None:
                raise RuntimeError(f"unexpected answer: {buf[:300]!r}")
            out.append((first - t0) * 1000)
    finally:
        writer.close()
    return out


def _cpu_ticks(pids: dict[str, int]) -> dict[str, int]:
    """user + system CPU ticks of each process so far (fields 14 and 15 of /proc/PID/stat;
    the name in field 2 may hold spaces, so count from its closing parenthesis)."""
    out = {}
    for name, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = int(fields[11]) + int(fields[12])
    return out


def _cpu_ms_per_request(before: dict[str, int], after: dict[str, int], n: int) -> dict[str, float]:
    hz = os.sysconf("SC_CLK_TCK")
    ms = {k: round((after[k] - before[k]) * 1000 / hz / n, 3) for k in before}
    return {**ms, "total": round(sum(ms.values()), 3)}


Layer = Callable[[list[list[int]]], Awaitable[list[float]]]


def _layers(cfg: ClusterConfig, base_url: str) -> dict[str, Layer]:
    model = served_name(cfg)
    return {
        "engine": lambda ps: engine_ttft(cfg, ps),
        "decode": lambda ps: decode_ttft(f"127.0.0.1:{cfg.decode.port}", ps),
        "router": lambda ps: router_rtt(f"127.0.0.1:{cfg.router.port}", ps),
        "processor": lambda ps: processor_ttft(f"127.0.0.1:{cfg.processor.port}", ps),
        "http": lambda ps: http_ttft(base_url, model, ps),
        "http_raw": lambda ps: http_raw_ttft(base_url, model, ps),
    }


async def measure(args: argparse.Namespace, cfg: ClusterConfig, base_url: str, run_dir: Path) -> dict:
    funcs = _layers(cfg, base_url)
    pids = cluster_processes(run_dir) if args.cpu_per_request else {}
    res: dict = {"layers": {}, "cpu_ms_per_request": {}} if pids else {"layers": {}}
    for k, layer in enumerate(args.layers.split(",")):
        prompts = _prompts(args.warmup + args.n, args.prompt_len, seed=100 + k)
        if not pids:
            ms = (await funcs[layer](prompts))[args.warmup:]
        else:
            # NOTE: warm-up as a call of its own, so that the CPU counted is the measured
            # requests' alone (the engine layer is excluded: it would build a second engine)
            if args.warmup:
                await funcs[layer](prompts[:args.warmup])
            before = _cpu_ticks(pids)
            ms = await funcs[layer](prompts[args.warmup:])
            res["cpu_ms_per_request"][layer] = _cpu_ms_per_request(before, _cpu_ticks(pids), args.n)
        res["layers"][layer] = _stats(ms)
    return res


def main(args: argparse.Namespace) -> int:
    layers = args.layers.split(",")
    unknown = [x for x in layers if x not in OVERHEAD_LAYERS.split(",")]
    if unknown or args.n < 1 or args.warmup < 0:
        raise SystemExit(f"tandem bench overhead: unknown layers {unknown} or --n < 1 or --warmup < 0")
    if args.cpu_per_request and "engine" in layers:
        raise SystemExit("tandem bench overhead: --cpu-per-request measures cluster processes: "
                         "leave the engine layer out (--layers)")
    head = header(args)
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(cfg.engine.threads)  # as the decode worker process does
    base_url = args.base_url or f"http://127.0.0.1:{cfg.frontend.port}"
    run_dir = Path(args.run_dir)
    with cluster_if_asked(args, base_url):
        # the client on uvloop too, as the parts run: less client time in the figures
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            res = runner.run(measure(args, cfg, base_url, run_dir))
    res = finish(head, {**res, "n": args.n, "warmup": args.warmup, "prompt_len": args.prompt_len})
    print(json.dumps(res, indent=1))
    write_json(args.json_path, res)
    return 0
