"""A cluster started for a benchmark: `tandem up` as a subprocess, ready once the frontend's
/health is 200, stopped with SIGTERM (the launcher stops its children) when done, or when
the bench is itself terminated (services/common/children.py).

`bench compare` starts one per run, `bench overhead --up` one for its layers; the launcher's
``processes.json`` in the run directory names every child, which is how `bench overhead
--cpu-per-request` finds the processes whose CPU time it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from services.common import children, env


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the cluster exited with code {proc.returncode} before /health")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/health not 200 after {timeout_s:.0f}s")


@contextmanager
def running_cluster(config: str | None, overrides: Sequence[str], url: str, run_dir: Path,
                    log_path: Path, ready_timeout_s: float,
                    settle_s: float) -> Iterator[subprocess.Popen]:
    """`tandem up` with ``run_dir`` as its run directory and its output in ``log_path``;
    yields once ``url``/health answers and ``settle_s`` more have passed (discovery needs
    a moment to spread every worker to the router).

    The cluster's gRPC token is this process's ``TANDEM_CLUSTER_TOKEN`` (made here when
    unset, and unset again when the cluster stops): `tandem up` hands it to its parts, and
    benches that call a part's gRPC directly (`bench overhead`'s decode, router and
    processor layers) carry it."""
    made = env.CLUSTER_TOKEN not in os.environ
    if made:
        os.environ[env.CLUSTER_TOKEN] = secrets.token_urlsafe(32)
    try:
        yield from _run(config, overrides, url, run_dir, log_path, ready_timeout_s, settle_s)
    finally:
        if made:
            # NOTE: a caller that goes on in-process (a test) must not keep the token: its
            # own servers would then demand it of clients that do not send it.
            os.environ.pop(env.CLUSTER_TOKEN, None)


def _run(config: str | None, overrides: Sequence[str], url: str, run_dir: Path,
         log_path: Path, ready_timeout_s: float, settle_s: float) -> Iterator[subprocess.Popen]:
    # --fail-fast: a part restarted mid-run would skew the figures without a word; a run
    # where one dies must fail instead.
    argv = [sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir), "--fail-fast"]
    if config is not None:
        argv += ["-c", config]
    for o in overrides:
        argv += ["--set", o]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        # a launcher killed after its stop timeout leaves its parts (each in a session of
        # its own) running: those are killed by the pids it wrote down
        proc = children.spawn(argv, stop_timeout_s=60.0, orphans=lambda: _pids(run_dir),
                              stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, proc, ready_timeout_s)
            time.sleep(settle_s)
            yield proc
        finally:
            children.stop(proc)


@contextmanager
def cluster_if_asked(args: argparse.Namespace, base_url: str) -> Iterator[None]:
    """With ``args.up``: `tandem up` of ``args.config`` (``args.overrides``) in ``args.run_dir``
    for the run; without it, the cluster at ``base_url`` is used as it is."""
    if not args.up:
        yield
        return
    run_dir = Path(args.run_dir)
    print(f"starting the cluster (run dir {run_dir}) ...", flush=True)
    with running_cluster(args.config, args.overrides, base_url, run_dir,
                         run_dir.with_suffix(".log"), args.ready_timeout, 2.0):
        yield


def cluster_processes(run_dir: Path) -> dict[str, int]:
    """Process name (``nats``, ``router``, ``decode-0``, ...) -> pid, from the launcher's
    ``processes.json``."""
    rows = json.loads((run_dir / "processes.json").read_text())
    return {r["name"]: int(r["pid"]) for r in rows}


def _pids(run_dir: Path) -> list[int]:
    try:
        return list(cluster_processes(run_dir).values())
    except (OSError, ValueError):  # not written yet, or cut short
        return []
