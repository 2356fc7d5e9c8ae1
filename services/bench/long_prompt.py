"""``tandem bench long-prompt``: one very long prompt beside a stream of short requests.

What a user of a shared cluster feels when someone sends an 8,000-token prompt: the short
requests' time to first token (p50/p99) while the long one is being prefilled, and how many
times the long prompt was prefilled (it must be once: remote, or local after a fallback,
never both). Prefill counts come from the decode and prefill workers' /metrics, read before
and after the run (so run it on a cluster with one decode and one prefill worker, or read
the counts as totals over the workers listed in the config).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re

import httpx
import numpy as np

from services.bench.client import RequestRecord, send
from services.bench.cluster import cluster_if_asked
from services.bench.results import finish, header, write_json
from services.bench.workloads import ID_HIGH, ID_LOW
from services.common.config import ClusterConfig, load_config

_SAMPLE = re.compile(r'^(tandem_\w+)(?:\{([^}]*)\})? ([0-9.eE+-]+)$')


def _metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for tandem's series."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[f"{m[1]}{{{m[2] or ''}}}"] = float(m[3])
    return out


async def _scrape(client: httpx.AsyncClient, ports: list[int]) -> dict[str, float]:
    total: dict[str, float] = {}
    for port in ports:
        r = await client.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        for k, v in _metrics(r.text).items():
            total[k] = total.get(k, 0.0) + v
    return total


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _ms(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1000, 1) if xs else None


async def measure(args: argparse.Namespace, cfg: ClusterConfig, base_url: str) -> dict:
    rng = np.random.default_rng(args.seed)
    url = base_url.rstrip("/") + "/v1/completions"
    decode_ports = [cfg.decode.metrics_port + i for i in range(cfg.decode.replicas)]
    prefill_ports = [cfg.prefill.metrics_port + i for i in range(cfg.prefill.replicas)]

    def body(n: int, max_tokens: int) -> dict:
        ids = [int(x) for x in rng.integers(ID_LOW, ID_HIGH, size=n)]
        return {"model": args.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        before = await _scrape(client, decode_ports + prefill_ports)
        long = RequestRecord(0, args.long_tokens)
        shorts = [RequestRecord(i + 1, args.short_tokens) for i in range(args.shorts)]
        tasks = [asyncio.create_task(send(client, url, body(args.long_tokens, 4), long,
                                          args.timeout))]
        await asyncio.sleep(args.short_delay)  # the long prompt is being prefilled by now
        for rec in shorts:
            tasks.append(asyncio.create_task(send(client, url, body(args.short_tokens, 8), rec,
                                                  args.timeout)))
            await asyncio.sleep(args.short_interval)
        await asyncio.gather(*tasks)
        after = await _scrape(client, decode_ports + prefill_ports)

    ttft = [r.first_token_time - r.send_time for r in shorts if r.ok and r.first_token_time]
    remote = _delta(after, before, 'tandem_prefill_jobs_total{outcome="delivered"}')
    withdrawn = _delta(after, before, 'tandem_prefill_jobs_total{outcome="withdrawn"}')
    # computed remotely in full, then refused: the decode worker had given up on it
    rejected = _delta(after, before, 'tandem_prefill_jobs_total{outcome="rejected"}')
    fallbacks = sum(v - before.get(k, 0.0) for k, v in after.items()
                    if k.startswith("tandem_worker_remote_prefill_fallbacks_total{"))
    local = _delta(after, before, 'tandem_worker_prefill_total{where="local"}')
    return {
        "long_prompt_tokens": args.long_tokens, "shorts": args.shorts,
        "short_prompt_tokens": args.short_tokens,
        "long_ok": long.ok, "long_error": long.error,
        "long_ttft_s": round(long.first_token_time - long.send_time, 3)
        if long.ok and long.first_token_time else None,
        "shorts_ok": sum(r.ok for r in shorts),
        "short_ttft_ms": {"p50": _ms(ttft, 50), "p99": _ms(ttft, 99), "max": _ms(ttft, 100)},
        # Every short request prefills locally (under decode.disagg.max_local_prefill_length),
        # so the long prompt's local prefills are the local ones beyond the shorts.
        "long_prompt_prefills": {"remote_delivered": remote,
                                 "local": local - args.shorts,
                                 "remote_withdrawn": withdrawn,
                                 "remote_rejected": rejected,
                                 "fallbacks": fallbacks},
    }


def main(args: argparse.Namespace) -> int:
    head = header(args)
    cfg = load_config(args.config, args.overrides)
    base_url = args.base_url or f"http://127.0.0.1:{cfg.frontend.port}"
    with cluster_if_asked(args, base_url):
        res = asyncio.run(measure(args, cfg, base_url))
    res = finish(head, res)
    print(json.dumps(res, indent=1))
    write_json(args.json_path, res)
    return 0 if res["long_ok"] and res["shorts_ok"] == args.shorts else 1
