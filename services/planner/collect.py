"""The planner's signals from a live cluster (docs/planner.md, "Each signal and where it
comes from"), one ``ClusterSignals`` per ``collect()``:

- workers and roles: discovery (services/common/discovery.py), read each round;
- decode workers' KV use, running and waiting requests, pending prefill tokens: the
  ``WorkerLoad`` samples they publish on ``{ns}.load.<id>`` (the router's source too);
  prefill workers publish none, so theirs come from their /metrics gauges;
- the prefill queue: its stream's state (``$JS.API.STREAM.INFO``): jobs waiting or running,
  their bytes, the first stored job's timestamp. NOTE: the planner never reads a job (a
  job carries the prompt and its KV transfer token, and no role but the prefill workers
  may read them), so the queue's tokens are estimated from its bytes (``queue_tokens``);
- the last interval's traffic: the frontends' TTFT and ITL histograms and the processors'
  request and token counters, scraped from the /metrics addresses discovery publishes and
  differenced between two rounds; prefill throughput from the prefill workers' prompt
  token counters and engine step seconds the same way.

Scraping the histograms the parts already export changes nothing in the request path;
a per-request record on NATS would have added a publish per request to the processor,
and it is read only every ``planner.interval_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import httpx
import nats.errors
from nats.aio.msg import Msg

from services.api.wire import WireError, WorkerLoad, decode_load
from services.common.discovery import Discovery, Registration
from services.common.nats_client import NatsClient, Subjects
from services.planner.prom import Scrape, add_buckets, bucket_delta, delta, quantile, scrape
from services.planner.signals import ClusterSignals, IntervalStats, Role, WorkerSignals

log = logging.getLogger(__name__)

# A job's bytes beyond its prompt (request id, sampling, addresses, transfer token, the
# subject and JetStream's own headers), and a prompt's bytes per token: token ids are packed
# varints (1 byte under 128, 2 under 16384, 3 up to 2**21). Measured: 1.87 bytes per token
# on English text with SmolLM2's vocabulary (frequent tokens have small ids); a larger
# vocabulary gives more, so the estimate is high for SmolLM2 by a few percent, low beyond.
JOB_OVERHEAD_BYTES = 200
BYTES_PER_TOKEN = 2.0
_SCRAPE_TIMEOUT_S = 2.0
_FRACTION = re.compile(r"\.(\d{6})\d*")


@dataclass(frozen=True, slots=True)
class QueueState:
    jobs: int
    bytes: int
    oldest_unix: float | None  # the first stored job's publish time; None when empty


def queue_tokens(q: QueueState) -> int:
    """Prompt tokens in the queue, estimated from its bytes (the jobs are not read)."""
    return max(0, round((q.bytes - q.jobs * JOB_OVERHEAD_BYTES) / BYTES_PER_TOKEN))


def _unix(ts: str) -> float | None:
    """An RFC 3339 time as JetStream writes it (nanoseconds, ``Z``); None for its zero."""
    if not ts or ts.startswith("0001-"):
        return None
    return datetime.fromisoformat(_FRACTION.sub(r".\1", ts).replace("Z", "+00:00")).timestamp()


async def queue_state(nc: NatsClient, subjects: Subjects) -> QueueState:
    """The prefill stream's state; an empty queue when the stream does not exist yet."""
    reply = await nc.request(f"$JS.API.STREAM.INFO.{subjects.prefill_stream}", b"", timeout=_SCRAPE_TIMEOUT_S)
    info = json.loads(reply.data)
    if "error" in info:
        return QueueState(0, 0, None)
    state = info.get("state", {})
    jobs = int(state.get("messages", 0))
    return QueueState(jobs, int(state.get("bytes", 0)), _unix(state.get("first_ts", "")) if jobs else None)


class LiveCollector:
    """Owns the load subscription and the previous round's counters; ``start`` then
    ``collect`` every interval, ``close`` at the end."""

    def __init__(self, nc: NatsClient, namespace: str, discovery: Discovery,
                 http: httpx.AsyncClient | None = None, clock: Callable[[], float] = time.time) -> None:
        self._nc, self._subjects, self._discovery = nc, Subjects(namespace), discovery
        self._http = http if http is not None else httpx.AsyncClient(timeout=_SCRAPE_TIMEOUT_S)
        self._clock = clock
        self._loads: dict[str, WorkerLoad] = {}
        self._sub = None
        self._prev: dict[str, Scrape] = {}  # "role/instance" -> last round's scrape
        self._prev_t: float | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._subjects.load_all, cb=self._on_load)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass
            self._sub = None
        await self._http.aclose()

    async def _on_load(self, msg: Msg) -> None:
        try:
            load = decode_load(msg.data)
        except WireError as e:
            log.warning("ignoring a bad load sample on %s: %s", msg.subject, e)
            return
        self._loads[load.worker_id] = load

    async def _scrapes(self, regs: list[Registration]) -> dict[str, Scrape]:
        got = await asyncio.gather(*(scrape(self._http, r.metrics_address) for r in regs))
        return {f"{r.role}/{r.instance_id}": s for r, s in zip(regs, got, strict=True) if s is not None}

    async def collect(self) -> ClusterSignals:
        roles = ("decode", "prefill", "frontend", "processor")
        regs = dict(zip(roles, await asyncio.gather(*(self._discovery.registrations(r) for r in roles)),
                        strict=True))
        queue = await queue_state(self._nc, self._subjects)
        scrapes = await self._scrapes([r for role in ("prefill", "frontend", "processor")
                                       for r in regs[role] if r.metrics_address])
        now = self._clock()
        live = {r.instance_id for r in regs["decode"]}
        for gone in set(self._loads) - live:  # left discovery: its last sample is stale
            del self._loads[gone]
        workers = [_decode_worker(r.instance_id, self._loads.get(r.instance_id)) for r in regs["decode"]]
        workers += [_prefill_worker(r.instance_id, scrapes.get(f"prefill/{r.instance_id}"))
                    for r in regs["prefill"]]
        last = self._interval(scrapes, now)
        self._prev, self._prev_t = scrapes, now
        return ClusterSignals(
            t=now, workers=tuple(sorted(workers, key=lambda w: (w.role, w.worker_id))),
            prefill_queue_jobs=queue.jobs, prefill_queue_tokens=queue_tokens(queue),
            prefill_queue_oldest_wait_s=max(0.0, now - queue.oldest_unix) if queue.oldest_unix else 0.0,
            last=last)

    def _interval(self, scrapes: dict[str, Scrape], now: float) -> IntervalStats:
        """What the counters and histograms added since the previous round."""
        duration = now - self._prev_t if self._prev_t is not None else 0.0

        def added(role: str, name: str) -> float:
            return sum(delta(s.get(name), self._prev[k].get(name) if k in self._prev else None)
                       for k, s in scrapes.items() if k.startswith(role + "/"))

        def hist(name: str) -> float | None:
            parts = [bucket_delta(s.buckets.get(name, {}),
                                  self._prev[k].buckets.get(name) if k in self._prev else None)
                     for k, s in scrapes.items() if k.startswith("frontend/")]
            return quantile(0.9, add_buckets(parts))

        finished = added("processor", "tandem_processor_requests_total")
        inflight_change = sum(s.get("tandem_processor_requests_inflight")
                              - self._prev[k].get("tandem_processor_requests_inflight")
                              for k, s in scrapes.items() if k.startswith("processor/") and k in self._prev)
        arrivals = max(0, round(finished + inflight_change))
        prompt = added("processor", "tandem_processor_prompt_tokens_total")
        completion = added("processor", "tandem_processor_completion_tokens_total")
        computed = (added("prefill", "tandem_worker_prompt_tokens_total")
                    - added("prefill", "tandem_worker_prefix_cache_hit_tokens_total"))
        return IntervalStats(
            duration_s=duration, arrivals=arrivals,
            mean_input_tokens=prompt / arrivals if arrivals else 0.0,
            mean_output_tokens=completion / finished if finished else 0.0,
            ttft_p90_s=hist("tandem_frontend_time_to_first_token_seconds"),
            itl_p90_s=hist("tandem_frontend_inter_token_latency_seconds"),
            prefill_tokens_done=max(0, round(computed)),
            prefill_busy_s=added("prefill", "tandem_worker_engine_step_seconds_sum"))


def _decode_worker(worker_id: str, load: WorkerLoad | None) -> WorkerSignals:
    if load is None:  # registered, no sample yet: counted, its load unknown (zero)
        return WorkerSignals(worker_id, Role.DECODE)
    return WorkerSignals(worker_id, Role.DECODE, load.kv_blocks_used, load.kv_blocks_total,
                         load.requests_running, load.requests_waiting, load.active_prefill_tokens,
                         load.decode_tokens_left, load.running_unbounded)


def _prefill_worker(worker_id: str, s: Scrape | None) -> WorkerSignals:
    if s is None:
        return WorkerSignals(worker_id, Role.PREFILL)
    return WorkerSignals(
        worker_id, Role.PREFILL, int(s.get("tandem_worker_kv_blocks_used")),
        int(s.get("tandem_worker_kv_blocks_total")), int(s.get("tandem_worker_requests_running")),
        int(s.get("tandem_worker_requests_waiting")), int(s.get("tandem_worker_prefill_tokens_pending")))
