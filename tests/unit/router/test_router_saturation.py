"""The router steers around decode workers whose load samples show a full waiting queue
(``decode.max_waiting_requests``), and still routes when every worker is full (the worker
then refuses, and the client gets 429)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.api.route import RouteRequest
from services.api.wire import WorkerLoad, encode_load
from services.common.config import parse_config
from services.common.discovery import Registration
from services.router.router import Router


@dataclass
class _Msg:  # the two fields of a NATS message the load handler reads
    data: bytes
    subject: str = "t.load.x"


async def _load(router: Router, worker: str, waiting: int) -> None:
    await router._on_load(_Msg(encode_load(WorkerLoad(worker, 0, 64, 4, waiting, 0, time.time()))))  # noqa: SLF001


async def _routes(router: Router, n: int, tag: str) -> set[str]:
    return {(await router.route(RouteRequest(f"{tag}{i}", [1, 2, 3, i]))).worker_id for i in range(n)}


async def test_saturated_workers_are_skipped_until_all_are_full() -> None:
    cfg = parse_config({"router": {"mode": "round_robin"}, "decode": {"max_waiting_requests": 5}})
    router = Router(cfg)
    for w in ("w0", "w1"):
        router.worker_joined(Registration("decode", w, address=f"{w}:1"))
    assert await _routes(router, 6, "a") == {"w0", "w1"}
    await _load(router, "w0", 5)
    assert await _routes(router, 6, "b") == {"w1"}
    await _load(router, "w1", 9)  # both full: route anyway; the worker answers
    assert await _routes(router, 6, "c") == {"w0", "w1"}
    await _load(router, "w1", 4)
    assert await _routes(router, 6, "d") == {"w1"}
    router.worker_left("w1")  # the only unsaturated one left: w0 is all there is
    assert await _routes(router, 3, "e") == {"w0"}
