"""Kill -9 each part of a running `tandem up` cluster in turn, under a light `tandem bench
serve` load, and print the "Death of a part under tandem up" table of docs/reliability.md.

    python -m services.cli up -c configs/local.yaml --run-dir /tmp/tandem-run > /tmp/up.log &
    tandem bench part-deaths --run-dir /tmp/tandem-run --up-log /tmp/up.log

For each part: wait until a request succeeds, start `bench serve` (its own process), kill
the part ``--kill-after`` seconds in, then record
- the seconds from the kill until `tandem up` prints the part ready again (the launcher's
  backoff included),
- one-token probe requests every 0.25 s for ``--watch`` seconds after the kill: how many
  failed, and the first and last failure (when the cluster stopped and resumed serving),
- how many of the load's requests failed, and with what.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.common import children


def restarts_ready(up_log: Path, name: str) -> int:
    """How many times `tandem up` has said ``name`` is ready after a restart."""
    text = up_log.read_text(errors="replace")
    return len(re.findall(rf"^ready    {re.escape(name)} +[0-9.]+ s  after restart ", text, re.MULTILINE))


def probe(base_url: str, model: str) -> str | None:
    """None when a one-token completion succeeds, else what went wrong."""
    try:
        r = httpx.post(f"{base_url}/v1/completions", timeout=5,
                       json={"model": model, "prompt": "Hello", "max_tokens": 1})
    except httpx.HTTPError as e:
        return type(e).__name__
    if r.status_code == 200:
        return None
    try:
        return f"{r.status_code} {r.json()['error']['message'][:60]}"
    except (ValueError, KeyError, TypeError):
        return str(r.status_code)


def wait_serving(base_url: str, model: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while probe(base_url, model) is not None:
        if time.monotonic() > deadline:
            raise SystemExit(f"{base_url} not serving after {timeout:g} s")
        time.sleep(0.5)


def one_part(args: argparse.Namespace, name: str) -> dict:
    wait_serving(args.base_url, args.model)
    time.sleep(args.settle)
    out = args.out / f"{name}.json"
    bench = children.spawn(
        [sys.executable, "-m", "services.cli", "bench", "serve", "--base-url", args.base_url,
         "--model", args.model, "--workload", "mixed", "--short-len", "32", "--long-len", str(args.long_len),
         # gamma with a large shape: near-even arrivals, so every part's outage meets
         # the load alike (Poisson's gaps can hide a 10 s outage)
         "--long-fraction", "0.5", "--output-len", "16", "--arrival", "gamma", "--burstiness", "100",
         "--rate", str(args.rate), "--num-requests", str(args.num_requests), "--timeout", "60",
         "--json", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    time.sleep(args.kill_after)
    pid = {p["name"]: p["pid"] for p in json.loads((args.run_dir / "processes.json").read_text())}[name]
    seen = restarts_ready(args.up_log, name)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # Probe for the whole window, not just until the first success: some effects come late
    # (discovery entries that look expired ttl_s after a NATS restart).
    ready_s = None
    probe_failures: list[float] = []
    probe_errors: set[str] = set()
    while (now := time.monotonic() - t0) < args.watch:
        if ready_s is None and restarts_ready(args.up_log, name) > seen:
            ready_s = now
        err = probe(args.base_url, args.model)
        if err is not None:
            probe_failures.append(time.monotonic() - t0)
            probe_errors.add(re.sub(r"\d+", "N", err))
        time.sleep(0.25)
    bench.wait()
    children.stop(bench)  # forgotten, with anything it left in its group
    res = json.loads(out.read_text())
    failed = [r for r in res["requests"] if not r["ok"]]
    errors = sorted({re.sub(r"[0-9a-f]{8,}|\d+", "N", r["error"])[:90] for r in failed})
    return {"part": name, "requests": len(res["requests"]), "failed": len(failed),
            "ready_s": ready_s, "probes_failed": len(probe_failures),
            "first_failed_probe_s": probe_failures[0] if probe_failures else None,
            "last_failed_probe_s": probe_failures[-1] if probe_failures else None,
            "probe_errors": sorted(probe_errors), "errors": errors}


def main(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.parts.split(","):
        row = one_part(args, name)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| part killed | load requests failed | ready again (s) | probes failed "
          "| failed probes from - to (s) | errors seen by the load |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        window = (f"{fmt(r['first_failed_probe_s'])} - {fmt(r['last_failed_probe_s'])}"
                  if r["probes_failed"] else "-")
        print(f"| {r['part']} | {r['failed']} of {r['requests']} | {fmt(r['ready_s'])} | "
              f"{r['probes_failed']} | {window} | {'; '.join(r['errors']) or '-'} |")
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    return 0

