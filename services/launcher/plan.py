"""What `tandem up` starts: a pure function from the cluster config to a process list.

Order matters twice: processes start in this order (nats-server first, and everything
else only once it accepts connections), and stop in the reverse order (the frontend stops
taking requests before the workers behind it go away, NATS goes last so everyone can
deregister).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from services.common.config import ClusterConfig
from services.launcher.nats import nats_argv, nats_endpoint
from services.launcher.secret_overrides import env_for, split_overrides

# NOTE: the planner starts last and stops first: nothing is scaled while the cluster stops.
PARTS = ("nats", "router", "encode", "decode", "prefill", "processor", "frontend", "planner")

_ANY_HOST = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Readiness:
    """How the supervisor knows a process is serving: a TCP port that accepts, or an HTTP
    GET that answers 200."""

    kind: Literal["tcp", "http"]
    host: str
    port: int
    path: str = ""

    def describe(self) -> str:
        if self.kind == "http":
            return f"http://{self.host}:{self.port}{self.path}"
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class PortUse:
    """One port a process binds, with what it is for (``grpc``, ``metrics``, ``http``...)."""

    label: str
    port: int
    key: str  # the config key that sets it, for error messages


@dataclass(frozen=True)
class ProcessSpec:
    """One child process of the launcher."""

    name: str  # unique: "router", "decode-0", "prefill-1", ...
    part: str  # one of PARTS
    argv: tuple[str, ...]
    ports: tuple[PortUse, ...]
    ready: Readiness
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment
    # Start nothing after this process until it is ready (NATS: everyone connects to it).
    barrier: bool = False
    # What asks it to stop: nats-server exits 1 on SIGTERM but cleanly (0) on SIGINT.
    stop_signal: int = signal.SIGTERM

    def address(self, host: str) -> str:
        return ", ".join(f"{p.label} {host}:{p.port}" for p in self.ports)


def _probe_host(bind_host: str) -> str:
    """Where to connect to reach a server bound to ``bind_host``."""
    return "127.0.0.1" if bind_host in _ANY_HOST else bind_host


def _threads_env(threads: int) -> dict[str, str]:
    # NOTE: torch sizes its pools from these at import; every child gets them explicitly
    # so N workers on one machine do not each grab every core.
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "PYTHONUNBUFFERED": "1"}


_ArgvOf = Callable[[str, int | None], tuple[str, ...]]


def _argv_of(config_path: str | Path | None, overrides: list[str], python: str) -> tuple[_ArgvOf, dict[str, str]]:
    """How a part's command line is made (and the secret overrides that go by env)."""
    common: list[str] = []
    if config_path is not None:
        common += ["-c", str(Path(config_path).resolve())]
    public, secret_env = split_overrides(list(overrides))  # secrets go by env, not argv
    for o in public:
        common += ["--set", o]

    def part_argv(part: str, replica: int | None) -> tuple[str, ...]:
        tail = () if replica is None else ("--replica", str(replica))
        return (python, "-m", "services.cli", part, *common, *tail)

    return part_argv, secret_env


def _decode_spec(cfg: ClusterConfig, first: int, last: int, part_argv: _ArgvOf) -> ProcessSpec:
    """Replicas first..last in one process (K > 1: the mock runner at scale)."""
    d = cfg.decode
    argv = part_argv("decode", first)
    if d.replicas_per_process > 1:
        argv += ("--replicas-in-process", str(last - first + 1))
    ports = tuple(u for i in range(first, last + 1)
                  for u in (PortUse("grpc", d.port + i, "decode.port"),
                            PortUse("metrics", d.metrics_port + i, "decode.metrics_port")))
    return ProcessSpec(
        name=f"decode-{first}" if d.replicas_per_process == 1 else f"decode-{first}-{last}",
        part="decode", argv=argv, ports=ports,
        # the last replica's port: a process starts its workers one after another
        ready=Readiness("tcp", "127.0.0.1", d.port + last), env=_threads_env(cfg.engine.threads),
    )


def _prefill_spec(cfg: ClusterConfig, i: int, part_argv: _ArgvOf) -> ProcessSpec:
    # A prefill worker serves no RPC (it pulls from JetStream); its metrics endpoint comes
    # up once it is running, so that is its readiness.
    p = cfg.prefill
    return ProcessSpec(
        name=f"prefill-{i}", part="prefill", argv=part_argv("prefill", i),
        ports=(PortUse("metrics", p.metrics_port + i, "prefill.metrics_port"),),
        ready=Readiness("tcp", "127.0.0.1", p.metrics_port + i), env=_threads_env(cfg.engine.threads),
    )


def plan(
    cfg: ClusterConfig,
    config_path: str | Path | None,
    overrides: list[str] = (),
    *,
    nats_data_dir: Path = Path("nats"),
    nats_binary: str = "nats-server",
    python: str = sys.executable,
) -> list[ProcessSpec]:
    """Every process `tandem up` starts for ``cfg``, in start order.

    Each tandem part runs as ``python -m services.cli <part> [-c FILE] [--set k=v]...
    --replica N``, so children read the same file with the same overrides as the launcher.
    Ports follow the CLI conventions: replica i of router/decode/prefill uses base port + i.
    """
    part_argv, secret_env = _argv_of(config_path, overrides, python)
    other_env = _threads_env(1)
    specs: list[ProcessSpec] = []

    if cfg.nats.embedded:
        host, port = nats_endpoint(cfg.nats.url)
        specs.append(ProcessSpec(
            name="nats", part="nats",
            argv=tuple(nats_argv(nats_binary, cfg.nats.url, nats_data_dir)),
            ports=(PortUse("client", port, "nats.url"),),
            ready=Readiness("tcp", _probe_host(host), port),
            barrier=True,
            stop_signal=signal.SIGINT,
        ))

    r = cfg.router
    for i in range(r.replicas):
        # NOTE: one replica keeps the name "router" (logs, --only, the NATS user it gets)
        specs.append(ProcessSpec(
            name="router" if r.replicas == 1 else f"router-{i}", part="router",
            argv=part_argv("router", i),
            ports=(PortUse("grpc", r.port + i, "router.port"),
                   PortUse("metrics", r.metrics_port + i, "router.metrics_port")),
            ready=Readiness("tcp", "127.0.0.1", r.port + i), env=other_env,
        ))
    e = cfg.encode
    for i in range(e.replicas):
        specs.append(ProcessSpec(
            name=f"encode-{i}", part="encode", argv=part_argv("encode", i),
            ports=(PortUse("grpc", e.port + i, "encode.port"),
                   PortUse("metrics", e.metrics_port + i, "encode.metrics_port")),
            ready=Readiness("tcp", "127.0.0.1", e.port + i), env=_threads_env(cfg.engine.threads),
        ))
    d = cfg.decode
    for first in range(0, d.replicas, d.replicas_per_process):
        specs.append(_decode_spec(cfg, first, min(first + d.replicas_per_process, d.replicas) - 1, part_argv))
    specs += [_prefill_spec(cfg, i, part_argv) for i in range(cfg.prefill.replicas)]
    pr = cfg.processor
    specs.append(ProcessSpec(
        name="processor", part="processor", argv=part_argv("processor", 0),
        ports=(PortUse("grpc", pr.port, "processor.port"),
               PortUse("metrics", pr.metrics_port, "processor.metrics_port")),
        ready=Readiness("tcp", "127.0.0.1", pr.port), env=other_env,
    ))
    f = cfg.frontend
    specs.append(ProcessSpec(
        name="frontend", part="frontend", argv=part_argv("frontend", 0),
        ports=(PortUse("http", f.port, "frontend.port"),),
        # /health is 200 only once a router and a decode worker are discovered: the whole
        # cluster's ready condition.
        ready=Readiness("http", _probe_host(f.host), f.port, "/health"), env=other_env,
    ))
    pl = cfg.planner
    if pl.enabled:
        if pl.metrics_port is None:
            raise ValueError("planner.metrics_port is null: `tandem up` needs it to see the planner ready")
        specs.append(ProcessSpec(
            name="planner", part="planner", argv=part_argv("planner", None),
            ports=(PortUse("metrics", pl.metrics_port, "planner.metrics_port"),),
            ready=Readiness("tcp", "127.0.0.1", pl.metrics_port), env=other_env,
        ))
    return [replace(s, env={**s.env, **env_for(s.part, secret_env)}) for s in specs]


def reserve(cfg: ClusterConfig, config_path: str | Path | None, overrides: list[str] = (),
            *, python: str = sys.executable) -> list[ProcessSpec]:
    """The worker replicas the planner may start beyond the configured ones (up to
    ``planner.max_decode``/``max_prefill``), ports base + index like the rest; none unless
    the planner is enabled with the local actuator. Their NATS users and ports are made
    and checked with the plan's, so a replica started later can log in and bind."""
    pl = cfg.planner
    if not (pl.enabled and pl.actuator == "local"):
        return []
    if cfg.decode.replicas_per_process != 1:
        raise ValueError("planner.actuator=local scales one decode worker per process: "
                         "set decode.replicas_per_process to 1")
    part_argv, secret_env = _argv_of(config_path, overrides, python)
    specs = [_decode_spec(cfg, i, i, part_argv) for i in range(cfg.decode.replicas, pl.max_decode)]
    specs += [_prefill_spec(cfg, i, part_argv) for i in range(cfg.prefill.replicas, pl.max_prefill)]
    return [replace(s, env={**s.env, **env_for(s.part, secret_env)}) for s in specs]


def select_parts(specs: list[ProcessSpec], parts: list[str]) -> list[ProcessSpec]:
    """Keep only the processes of the named parts (``tandem up --only``)."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"--only: unknown part(s) {', '.join(unknown)}; parts are {', '.join(PARTS)}")
    return [s for s in specs if s.part in parts]


def launcher_ports(cfg: ClusterConfig) -> tuple[PortUse, ...]:
    """What the launcher itself binds: its /metrics, unless ``launcher.metrics_port`` is null,
    and the planner's control endpoint when the planner runs with the local actuator."""
    port = cfg.launcher.metrics_port
    ports = () if port is None else (PortUse("metrics", port, "launcher.metrics_port"),)
    if cfg.planner.enabled and cfg.planner.actuator == "local":
        ports += (PortUse("control", cfg.planner.control_port, "planner.control_port"),)
    return ports


def port_owners(specs: list[ProcessSpec], launcher: tuple[PortUse, ...] = ()) -> list[tuple[str, PortUse]]:
    """Every planned port with the name of what binds it (the launcher's own ones first)."""
    return [("launcher", p) for p in launcher] + [(s.name, p) for s in specs for p in s.ports]


def check_port_conflicts(specs: list[ProcessSpec], launcher: tuple[PortUse, ...] = ()) -> None:
    """ValueError naming both users when two planned processes (or a process and the
    launcher's ``launcher`` ports) would bind one port, or naming the key of a port left at 0."""
    seen: dict[int, str] = {}
    for name, p in port_owners(specs, launcher):
        if p.port == 0:
            raise ValueError(f"{p.key} is 0 (any free port): `tandem up` needs fixed ports")
        if p.port in seen:
            raise ValueError(
                f"port {p.port} is planned twice: {seen[p.port]} and {name} {p.label} "
                "(check the port keys in the config and the replica counts)"
            )
        seen[p.port] = f"{name} {p.label}"
