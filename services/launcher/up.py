"""`tandem up -c FILE [--set k=v] [--only parts] [--run-dir DIR] [--ready-timeout S]
[--fail-fast]`: start the whole cluster a config describes and supervise it until Ctrl-C,
restarting a part that dies (or, with --fail-fast, stopping everything when one does)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from services.common import env
from services.common.config import ClusterConfig, ConfigError, load_config
from services.common.env import cache_dir
from services.launcher.cluster_token import with_cluster_token
from services.launcher.control import serve_control
from services.launcher.metrics import LauncherMetrics
from services.launcher.nats import NatsServerNotFoundError, find_nats_server
from services.launcher.nats_auth import lock_nats
from services.launcher.plan import (
    PARTS,
    ProcessSpec,
    check_port_conflicts,
    launcher_ports,
    plan,
    reserve,
    select_parts,
)
from services.launcher.preflight import (
    PreflightError,
    check_external_nats,
    check_model,
    check_ports_free,
)
from services.launcher.restart import RestartPolicy
from services.launcher.supervisor import Supervisor


def default_run_dir() -> Path:
    """A fresh directory per run under the cache: logs, pids, and NATS's own store."""
    return cache_dir() / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def served_name(cfg: ClusterConfig) -> str:
    from services.model.store import served_model_name

    return cfg.model.name or served_model_name(cfg.model.path)


def curl_example(cfg: ClusterConfig) -> str:
    base = f"http://{_display_host(cfg.frontend.host)}:{cfg.frontend.port}"
    body = json.dumps({
        "model": served_name(cfg),
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        "max_tokens": 32,
        "temperature": 0,
    })
    auth = ' -H "Authorization: Bearer $TANDEM_API_KEY"' if cfg.frontend.api_keys else ""
    return (f"curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"    -d {shlex.quote(body)}")


def banner(cfg: ClusterConfig, specs: list[ProcessSpec], run_dir: Path, elapsed: float,
           fail_fast: bool = False) -> str:
    lines = [""]
    if any(s.part == "frontend" for s in specs):
        base = f"http://{_display_host(cfg.frontend.host)}:{cfg.frontend.port}"
        lines.append(f"tandem is ready in {elapsed:.1f} s: {base}/v1  (model {served_name(cfg)})")
    else:
        lines.append(f"started in {elapsed:.1f} s (no frontend in this run)")
    width = max(len("launcher"), *(len(s.name) for s in specs))
    for s in specs:
        host = "127.0.0.1" if s.part != "nats" else s.ready.host
        lines.append(f"  {s.name:<{width}}  {s.address(host)}")
    if not cfg.nats.embedded:
        lines.append(f"  {'nats':<{width}}  external {cfg.nats.url}")
    for p in launcher_ports(cfg):
        lines.append(f"  {'launcher':<{width}}  {p.label} 127.0.0.1:{p.port}")
    lines.append(f"  logs: {run_dir / 'logs'}")
    if any(s.part == "frontend" for s in specs):
        lines += ["", "try:", "  " + curl_example(cfg)]
    on_death = "Any part that dies stops the cluster" if fail_fast else "A part that dies is restarted"
    lines += ["", f"{on_death}; Ctrl-C stops the cluster.", ""]
    return "\n".join(lines)


def prepare(args: argparse.Namespace) -> tuple[ClusterConfig, list[ProcessSpec], list[ProcessSpec], Path]:
    """Config, plan, the replicas the planner may add (plan.reserve) and every up-front
    check; raises ConfigError/PreflightError/ValueError."""
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    parts = [p.strip() for p in args.only.split(",") if p.strip()] if args.only else list(PARTS)
    nats_binary = "nats-server"
    if cfg.nats.embedded and "nats" in parts:
        try:
            nats_binary = find_nats_server()
        except NatsServerNotFoundError as e:
            raise PreflightError(str(e)) from None
    specs = select_parts(
        plan(cfg, args.config, args.overrides, nats_data_dir=run_dir / "nats", nats_binary=nats_binary),
        parts,
    )
    if not specs:
        raise PreflightError("nothing to start: the selected parts have no processes")
    spare = select_parts(reserve(cfg, args.config, args.overrides), parts) if "planner" in parts else []
    check_port_conflicts(specs + spare, launcher_ports(cfg))
    check_ports_free(specs + spare, launcher_ports(cfg))
    if not cfg.nats.embedded and "nats" in parts:
        check_external_nats(cfg)
    if {"decode", "prefill"} & {s.part for s in specs}:
        check_model(cfg)
    return cfg, specs, spare, run_dir


def main(args: argparse.Namespace) -> int:
    try:
        cfg, specs, spare, run_dir = prepare(args)
    except (ConfigError, PreflightError, ValueError) as e:
        print(f"tandem up: {e}", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    every = lock_nats(cfg, specs + spare, run_dir)  # users for the embedded nats-server
    every = with_cluster_token(every)  # the internal gRPC calls' credential
    specs, spare = every[:len(specs)], every[len(specs):]
    mode = "any death stops the cluster (--fail-fast)" if args.fail_fast else "a part that dies is restarted"
    print(f"tandem up: {len(specs)} processes, run directory {run_dir}; {mode}", flush=True)
    metrics = LauncherMetrics([s.name for s in specs])
    server = None
    if cfg.launcher.metrics_port is not None:
        try:
            server = metrics.serve(cfg.launcher.metrics_port)
        except OSError as e:  # taken between the preflight check and now
            print(f"tandem up: launcher.metrics_port {cfg.launcher.metrics_port}: {e}", file=sys.stderr)
            return 2
    sup = Supervisor(
        specs, run_dir, out=sys.stdout, echo=sys.stdout.isatty(),
        ready_timeout=args.ready_timeout, stop_timeout=args.stop_timeout,
        banner=lambda elapsed: banner(cfg, specs, run_dir, elapsed, args.fail_fast),
        policy=RestartPolicy.from_config(cfg.launcher), fail_fast=args.fail_fast, metrics=metrics,
        reserve=spare,
        # a drained worker's own grace (moving or finishing its requests), then a margin
        drain_timeout=max(cfg.decode.grace_period_s, cfg.prefill.grace_period_s) + args.stop_timeout,
    )
    control = None
    if any(s.part == "planner" for s in specs) and cfg.planner.actuator == "local":
        token = next(s.env[env.CLUSTER_TOKEN] for s in specs if s.part == "planner")
        try:
            control = serve_control(sup, cfg.planner.control_port, token)
        except OSError as e:
            print(f"tandem up: planner.control_port {cfg.planner.control_port}: {e}", file=sys.stderr)
            return 2
    try:
        return sup.run()
    finally:
        for srv in (server, control):
            if srv is not None:
                srv.shutdown()
                srv.server_close()
