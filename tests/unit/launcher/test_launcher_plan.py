"""`tandem up`'s plan: which processes, in which order, with which ports, argv and env."""

import socket
from pathlib import Path

import pytest

from services.cli import _HANDLERS, build_parser
from services.common.config import load_config, parse_config
from services.launcher.plan import check_port_conflicts, plan, select_parts
from services.launcher.preflight import PreflightError, check_ports_free, port_is_free

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _plan(name: str, overrides: list[str] = ()) -> list:
    path = CONFIGS / name
    return plan(load_config(path, overrides), path, list(overrides), python="py",
                nats_binary="/bin/nats-server", nats_data_dir=Path("/run/x/nats"))


def _ports(specs: list) -> dict[str, list[int]]:
    return {s.name: [p.port for p in s.ports] for s in specs}


def test_local_plan_order_ports_and_readiness() -> None:
    specs = _plan("local.yaml")
    assert [s.name for s in specs] == ["nats", "router", "decode-0", "prefill-0", "processor", "frontend"]
    assert _ports(specs) == {
        "nats": [4222], "router": [9200, 9201], "decode-0": [9300, 9400],
        "prefill-0": [9500], "processor": [9100, 9101], "frontend": [8000],
    }
    assert specs[0].argv == ("/bin/nats-server", "-js", "-sd", "/run/x/nats", "-p", "4222", "-a", "127.0.0.1")
    assert [s.barrier for s in specs] == [True, False, False, False, False, False]
    ready = {s.name: (s.ready.kind, s.ready.port, s.ready.path) for s in specs}
    assert ready["frontend"] == ("http", 8000, "/health")
    assert ready["decode-0"] == ("tcp", 9300, "") and ready["prefill-0"] == ("tcp", 9500, "")


def test_agg_plan_has_two_decoders_and_no_prefill() -> None:
    ports = _ports(_plan("agg.yaml"))
    assert ports["decode-0"] == [9300, 9400] and ports["decode-1"] == [9301, 9401]
    assert not any(n.startswith("prefill") for n in ports)


def test_disagg_plan_replica_ports() -> None:
    specs = _plan("disagg.yaml")
    assert [s.name for s in specs] == [
        "nats", "router", "decode-0", "decode-1", "prefill-0", "prefill-1", "processor", "frontend"]
    ports = _ports(specs)
    assert ports["prefill-0"] == [9500] and ports["prefill-1"] == [9501]
    assert ports["decode-1"] == [9301, 9401]
    check_port_conflicts(specs)


def test_router_replicas_each_get_a_process_and_ports() -> None:
    specs = _plan("disagg.yaml", ["router.replicas=3", "router.metrics_port=9250"])
    routers = [s for s in specs if s.part == "router"]
    assert [s.name for s in routers] == ["router-0", "router-1", "router-2"]
    assert [s.name for s in specs][:4] == ["nats", "router-0", "router-1", "router-2"]
    assert _ports(routers) == {"router-0": [9200, 9250], "router-1": [9201, 9251],
                               "router-2": [9202, 9252]}
    assert [s.ready.port for s in routers] == [9200, 9201, 9202]
    parser = build_parser()
    assert [parser.parse_args(list(s.argv[3:])).replica for s in routers] == [0, 1, 2]
    check_port_conflicts(specs)


def test_router_replicas_on_the_default_ports_clash() -> None:
    # replica 1's gRPC port is replica 0's metrics port: router.metrics_port must move
    specs = plan(parse_config({"router": {"replicas": 2}}), None)
    with pytest.raises(ValueError, match=r"port 9201 is planned twice: router-0 metrics and router-1 grpc"):
        check_port_conflicts(specs)


def test_children_get_config_overrides_replica_and_pinned_threads() -> None:
    overrides = ["engine.threads=3", "router.mode=round_robin"]
    specs = _plan("disagg.yaml", overrides)
    parser = build_parser()
    for s in specs[1:]:
        assert s.argv[:3] == ("py", "-m", "services.cli")
        args = parser.parse_args(list(s.argv[3:]))
        assert args._key == (s.part,) and args._key in _HANDLERS
        assert Path(args.config) == (CONFIGS / "disagg.yaml").resolve() and Path(args.config).is_absolute()
        assert args.overrides == overrides
        assert args.replica == (int(s.name.rsplit("-", 1)[1]) if "-" in s.name else 0)
        want = "3" if s.part in ("decode", "prefill") else "1"
        assert s.env["OMP_NUM_THREADS"] == want and s.env["MKL_NUM_THREADS"] == want


def test_external_nats_is_not_started() -> None:
    specs = plan(parse_config({"nats": {"url": "nats://10.0.0.1:4333", "embedded": False}}), None)
    assert specs[0].name == "router"
    assert "-c" not in specs[0].argv  # no file: children use the same built-in defaults


def test_frontend_on_all_interfaces_is_probed_on_loopback() -> None:
    specs = plan(parse_config({"frontend": {"host": "0.0.0.0", "port": 8123}}), None)
    assert specs[-1].ready.describe() == "http://127.0.0.1:8123/health"


def test_port_clash_between_parts_names_both() -> None:
    specs = plan(parse_config({"processor": {"port": 9200}}), None)
    with pytest.raises(ValueError, match=r"port 9200 is planned twice: router grpc and processor grpc"):
        check_port_conflicts(specs)


def test_replica_ranges_that_overlap_are_caught() -> None:
    specs = plan(parse_config({"decode": {"replicas": 3, "port": 9300, "metrics_port": 9302}}), None)
    with pytest.raises(ValueError, match=r"port 9302 is planned twice: decode-0 metrics and decode-2 grpc"):
        check_port_conflicts(specs)


def test_port_zero_is_refused_by_key() -> None:
    with pytest.raises(ValueError, match=r"router\.metrics_port is 0"):
        check_port_conflicts(plan(parse_config({"router": {"metrics_port": 0}}), None))


def test_select_parts() -> None:
    specs = _plan("disagg.yaml")
    assert [s.name for s in select_parts(specs, ["nats", "router"])] == ["nats", "router"]
    with pytest.raises(ValueError, match="unknown part.*decoder"):
        select_parts(specs, ["decoder"])


def test_busy_port_is_reported_with_its_key() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert not port_is_free(busy)
        specs = plan(parse_config({"router": {"metrics_port": busy}}), None)
        with pytest.raises(PreflightError, match=rf"port {busy} \(router metrics, set by router\.metrics_port\)"):
            check_ports_free(specs)
    assert port_is_free(busy)


def test_nats_is_stopped_with_sigint_and_the_parts_with_sigterm(tmp_path) -> None:
    import signal

    from services.common.config import parse_config
    from services.launcher.plan import plan

    specs = plan(parse_config({}), tmp_path / "c.yaml", nats_data_dir=tmp_path, nats_binary="nats-server")
    by_part = {s.part: s.stop_signal for s in specs}
    assert by_part["nats"] == signal.SIGINT
    assert {v for k, v in by_part.items() if k != "nats"} == {signal.SIGTERM}


def test_decode_replicas_per_process_groups_workers() -> None:
    cfg = parse_config({"engine": {"runner": "mock"},
                        "decode": {"replicas": 5, "replicas_per_process": 2}, "prefill": {"replicas": 0}})
    dec = [s for s in plan(cfg, None) if s.part == "decode"]
    assert [s.name for s in dec] == ["decode-0-1", "decode-2-3", "decode-4-4"]
    assert [s.argv[-4:] for s in dec[:2]] == [("--replica", "0", "--replicas-in-process", "2"),
                                              ("--replica", "2", "--replicas-in-process", "2")]
    assert dec[2].argv[-4:] == ("--replica", "4", "--replicas-in-process", "1")
    assert [p.port for p in dec[1].ports] == [9302, 9402, 9303, 9403]
    assert dec[1].ready.port == 9303
    check_port_conflicts(plan(cfg, None))


def test_every_tandem_process_gets_one_cluster_token_by_env_never_argv(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from services.launcher.cluster_token import with_cluster_token

    monkeypatch.delenv("TANDEM_CLUSTER_TOKEN", raising=False)
    specs = with_cluster_token(_plan("local.yaml"))
    tokens = {s.env.get("TANDEM_CLUSTER_TOKEN") for s in specs if s.part != "nats"}
    assert len(tokens) == 1 and None not in tokens and len(tokens.pop()) >= 32
    assert all("TANDEM_CLUSTER_TOKEN" not in s.env for s in specs if s.part == "nats")
    assert not any("TANDEM_CLUSTER_TOKEN" in a for s in specs for a in s.argv)
    again = with_cluster_token(_plan("local.yaml"))
    assert again[1].env["TANDEM_CLUSTER_TOKEN"] != specs[1].env["TANDEM_CLUSTER_TOKEN"]  # per run
    monkeypatch.setenv("TANDEM_CLUSTER_TOKEN", "given")  # a cluster parts can join by hand
    assert {s.env["TANDEM_CLUSTER_TOKEN"] for s in with_cluster_token(_plan("local.yaml"))
            if s.part != "nats"} == {"given"}


def test_multimodal_plan_starts_encode_workers_before_decode() -> None:
    specs = _plan("multimodal.yaml", ["encode.replicas=2"])
    assert [s.name for s in specs] == ["nats", "router", "encode-0", "encode-1", "decode-0", "processor", "frontend"]
    assert _ports(specs)["encode-1"] == [9601, 9701]
    enc = specs[3]
    args = build_parser().parse_args(list(enc.argv[3:]))
    assert args._key == ("encode",) and args._key in _HANDLERS and args.replica == 1
    assert (enc.ready.kind, enc.ready.port) == ("tcp", 9601)
    assert [s.name for s in select_parts(specs, ["encode"])] == ["encode-0", "encode-1"]


PLANNER = ["planner.enabled=true", "planner.max_decode=3", "planner.max_prefill=2"]


def test_the_planner_starts_last_and_its_replicas_are_planned_up_front() -> None:
    from services.launcher.plan import launcher_ports, reserve

    specs = _plan("local.yaml", PLANNER)
    assert [s.name for s in specs][-3:] == ["processor", "frontend", "planner"]
    planner = specs[-1]
    assert planner.argv[3] == "planner" and "--replica" not in planner.argv
    assert _ports([planner]) == {"planner": [9650]} and planner.ready.port == 9650
    cfg = load_config(CONFIGS / "local.yaml", PLANNER)
    spare = reserve(cfg, CONFIGS / "local.yaml", PLANNER, python="py")
    # the slots after the configured ones, ports base + index like plan() gives them
    assert _ports(spare) == {"decode-1": [9301, 9401], "decode-2": [9302, 9402], "prefill-1": [9501]}
    assert spare[0].argv[-2:] == ("--replica", "1")
    assert [p.port for p in launcher_ports(cfg)] == [9000, 9651]
    check_port_conflicts(specs + spare, launcher_ports(cfg))
    off = load_config(CONFIGS / "local.yaml")
    assert reserve(off, None) == [] and [p.port for p in launcher_ports(off)] == [9000]
    assert "planner" not in [s.name for s in plan(off, None)]


def test_the_local_actuator_scales_one_decode_worker_per_process() -> None:
    from services.launcher.plan import reserve

    cfg = load_config(CONFIGS / "local.yaml", [*PLANNER, "decode.replicas_per_process=2"])
    with pytest.raises(ValueError, match="decode.replicas_per_process to 1"):
        reserve(cfg, None)
