"""deploy/ without a Docker engine: compose, Prometheus, Grafana and the k8s manifests are
parsed and checked against the CLI parser, the cluster configs and the metric contract."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from services.cli import _HANDLERS, build_parser
from services.common.config import load_config
from services.common.nats_client import ROLES
from services.launcher.deploy_secrets import ROLE_UIDS, DeploySecrets
from services.launcher.nats import NatsServerNotFoundError, find_nats_server
from services.launcher.nats_auth import deploy_users, password_var, render_conf
from services.launcher.plan import plan
from services.launcher.replica_slot import parse_args as parse_slot_args

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
TANDEM_PARTS = ("router", "decode", "prefill", "processor", "frontend")

# The metrics docs/architecture.md ("Metrics") fixes for outside tools (dashboards, alerts);
# histograms also expose _bucket/_count/_sum series.
CONTRACT_METRICS = {
    "tandem_frontend_requests_total",
    "tandem_frontend_time_to_first_token_seconds",
    "tandem_frontend_inter_token_latency_seconds",
    "tandem_frontend_request_duration_seconds",
    "tandem_worker_kv_blocks_used",
    "tandem_worker_kv_blocks_total",
    "tandem_worker_engine_info",
    "tandem_worker_kv_blocks_cached",
    "tandem_worker_requests_running",
    "tandem_worker_requests_waiting",
    "tandem_worker_prompt_tokens_total",
    "tandem_worker_prefix_cache_hit_tokens_total",
    "tandem_worker_prefill_total",
    "tandem_worker_engine_step_seconds",
    "tandem_worker_engine_step_speed_ratio",
    "tandem_worker_engine_step_speed_spread",
    "tandem_worker_engine_step_modelled_seconds_total",
    "tandem_worker_engine_step_timed_seconds_total",
    "tandem_worker_request_queue_seconds",
    "tandem_worker_request_prefill_seconds",
    "tandem_worker_request_decode_seconds",
    "tandem_worker_grammar_compile_seconds",
    "tandem_worker_grammar_mask_fill_seconds",
    "tandem_worker_grammar_mask_wait_seconds",
    "tandem_worker_structured_requests_total",
    "tandem_worker_grammar_errors_total",
    "tandem_router_decisions_total",
    "tandem_router_route_seconds",
}


class _ComposeLoader(yaml.SafeLoader):
    """Compose's YAML: ``!reset []`` (an override's "drop the base file's value") reads as
    the string "!reset"."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")


def _load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _part_ports(cfg_name: str) -> dict[str, dict[str, int]]:
    """part -> {label: port} for replica 0, as `tandem up` would bind them."""
    cfg = load_config(ROOT / "configs" / cfg_name)
    out: dict[str, dict[str, int]] = {}
    for s in plan(cfg, None):
        if s.name in ("nats", *TANDEM_PARTS, "decode-0", "prefill-0"):
            out[s.part] = {p.label: p.port for p in s.ports}
    return out


def _check_tandem_command(argv: list[str], part: str, config_path: str) -> None:
    assert argv[0] == "tandem"
    args = build_parser().parse_args(argv[1:])
    assert args._key == (part,) and args._key in _HANDLERS
    assert args.config == config_path


def _tandem_argv(command: list[str]) -> list[str]:
    """The tandem command a service runs, through replica_slot for a scaled worker (which
    adds ``--replica <slot>``)."""
    if command[:3] == ["python", "-m", "services.launcher.replica_slot"]:
        return [*parse_slot_args(command[3:]).command, "--replica", "0"]
    return command


# -- compose --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())


def test_compose_services_run_real_tandem_subcommands(compose: dict) -> None:
    services = compose["services"]
    assert set(TANDEM_PARTS) | {"secrets", "nats", "prometheus", "grafana"} <= set(services)
    for part in TANDEM_PARTS:
        svc = services[part]
        mount = next(v for v in svc["volumes"] if v.startswith("../configs/compose.yaml:"))
        target = mount.split(":")[1]
        assert (DEPLOY / mount.split(":")[0]).resolve() == ROOT / "configs" / "compose.yaml"
        _check_tandem_command(_tandem_argv(svc["command"]), part, target)
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
    assert "-js" in services["nats"]["command"]
    # the official images by default; `make compose-test` sets local builds where none can be pulled
    assert services["nats"]["image"] == "${TANDEM_NATS_IMAGE:-nats:2.10}"
    assert services["prometheus"]["image"].startswith("${TANDEM_PROMETHEUS_IMAGE:-prom/prometheus:")
    assert services["grafana"]["image"].startswith("${TANDEM_GRAFANA_IMAGE:-grafana/grafana:")


def test_scaled_workers_take_a_slot_and_publish_their_own_address(compose: dict) -> None:
    services = compose["services"]
    for part in ("router", "decode", "prefill", "encode"):
        args = parse_slot_args(services[part]["command"][3:])
        assert args.directory == Path(f"/slots/{part}")
        assert any(v.startswith("replica-slots:/slots") for v in services[part]["volumes"])
        assert "--replica" not in args.command and "hostname" not in services[part]
    for part in ("decode", "encode"):  # the parts that serve gRPC to peers
        args = parse_slot_args(services[part]["command"][3:])
        assert args.advertise_ip == f"{part}.advertise_host"


def test_compose_ports_match_the_config(compose: dict) -> None:
    cfg = load_config(ROOT / "configs" / "compose.yaml")
    ports = _part_ports("compose.yaml")
    services = compose["services"]
    for part in ("router", "decode", "prefill", "processor"):
        assert sorted(int(p) for p in services[part]["expose"]) == sorted(ports[part].values())
    assert services["frontend"]["ports"] == [f"{cfg.frontend.port}:{cfg.frontend.port}"]
    assert services["nats"]["expose"] == [str(int(cfg.nats.url.rsplit(":", 1)[1]))]
    assert cfg.nats.url.split("//")[1].split(":")[0] == "nats"


def _scrape_targets(prom: dict) -> set[str]:
    out: set[str] = set()
    for job in prom["scrape_configs"]:
        out |= {t for sc in job.get("static_configs", []) for t in sc["targets"]}
        out |= {f"{n}:{sc['port']}" for sc in job.get("dns_sd_configs", []) for n in sc["names"]}
    return out


def _metrics_targets(cfg_name: str, host: str | None, replicas: int = 4) -> set[str]:
    """Every part's metrics address; replicas 0..3 of the scaled workers (base + i)."""
    ports = _part_ports(cfg_name)
    out: set[str] = set()
    for part in TANDEM_PARTS:
        port = ports[part]["metrics" if part != "frontend" else "http"]
        n = replicas if part in ("router", "decode", "prefill") else 1
        out |= {f"{host or part}:{port + i}" for i in range(n)}
    return out


def test_prometheus_scrapes_every_part_on_its_metrics_port(compose: dict) -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert _scrape_targets(prom) == _metrics_targets("compose.yaml", None)
    mount = next(v for v in compose["services"]["prometheus"]["volumes"] if "prometheus.yml" in v)
    assert (DEPLOY / mount.split(":")[0]).resolve() == DEPLOY / "prometheus" / "prometheus.yml"
    assert compose["services"]["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]


def test_dashboard_uses_only_contract_metrics_and_covers_the_required_views() -> None:
    dash = json.loads((DEPLOY / "grafana/dashboards/tandem.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"tandem_[a-z_]+", e)}
    assert used <= CONTRACT_METRICS, used - CONTRACT_METRICS
    text = "\n".join(exprs)
    assert "histogram_quantile(0.99, sum by (le) (rate(tandem_frontend_time_to_first_token_seconds_bucket" in text
    assert "histogram_quantile(0.5, sum by (le) (rate(tandem_frontend_inter_token_latency_seconds_bucket" in text
    assert 'tandem_worker_prefill_total{where="remote"}' in text
    for metric in ("tandem_worker_kv_blocks_used", "tandem_worker_prefix_cache_hit_tokens_total",
                   "tandem_worker_requests_waiting"):
        assert metric in text
    titles = {p["title"] for p in dash["panels"]}
    assert {"Time to first token", "Inter-token latency", "Tokens/s", "KV cache usage",
            "Prefix cache hit rate", "Remote prefill share", "Queue depth"} <= titles


def test_contract_metrics_are_the_architecture_docs_metrics_table() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(tandem_[a-z_]+)(?:\{[a-z]+\})?` \|", section, re.MULTILINE)
    assert len(rows) == len(set(rows))
    assert set(rows) == CONTRACT_METRICS


def test_dockerfile_takes_its_base_and_indexes_as_arguments_and_keeps_g_plus_plus_out() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    lines = text.splitlines()
    first_from = next(i for i, x in enumerate(lines) if x.startswith("FROM "))
    assert "ARG BASE_IMAGE=python:3.11-slim" in lines[:first_from]
    for arg in ("TORCH_VERSION=2.13.0", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu",
                "PIP_INDEX_URL=https://pypi.org/simple", "PIP_FIND_LINKS="):
        assert f"ARG {arg}" in lines
    stages = {x.split(" AS ")[1]: x.split()[1] for x in lines if x.startswith("FROM ") and " AS " in x}
    assert stages == {"base": "${BASE_IMAGE}", "torch": "base", "requirements": "base",
                      "deps": "torch", "model": "torch", "kernels": "torch", "runtime": "base"}
    runtime = text.split("AS runtime", 1)[1]
    assert "apt-get" not in runtime and "g++" not in runtime.replace("TANDEM_CXX", "")
    # the model and the kernels come from their stages, before the code (which changes most)
    order = [runtime.index(x) for x in ("--from=deps", "--from=model", "--from=kernels", "COPY services")]
    assert order == sorted(order)
    assert 'pull_default_model' in text.split("AS model", 1)[1].split("FROM ", 1)[0]


# -- kubernetes -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def k8s() -> dict[str, list[dict]]:
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    return {r: _load_all(DEPLOY / "k8s" / r) for r in kust["resources"]}


def test_k8s_configmap_is_the_k8s_cluster_config(k8s: dict) -> None:
    (cm,) = k8s["configmap.yaml"]
    assert cm["kind"] == "ConfigMap"
    assert cm["data"]["cluster.yaml"] == (ROOT / "configs" / "k8s.yaml").read_text()


def test_k8s_parts_run_real_subcommands_on_the_config_ports(k8s: dict) -> None:
    ports = _part_ports("k8s.yaml")
    (cm,) = k8s["configmap.yaml"]
    for part in TANDEM_PARTS:
        docs = {d["kind"]: d for d in k8s[f"{part}.yaml"]}
        pod = docs["Deployment"]["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        mount = container["volumeMounts"][0]
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == cm["metadata"]["name"]
        _check_tandem_command(container["command"], part, f"{mount['mountPath']}/cluster.yaml")
        container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container_ports == ports[part]
        service_ports = {p["name"]: p["port"] for p in docs["Service"]["spec"]["ports"]}
        assert service_ports == ports[part]
        assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
        assert pod["metadata"]["labels"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
        metrics = ports[part].get("metrics", ports[part].get("http"))
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(metrics)


def test_k8s_nats_has_jetstream_on_the_config_port(k8s: dict) -> None:
    docs = {d["kind"]: d for d in k8s["nats.yaml"]}
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert "-js" in container["args"]
    cfg = load_config(ROOT / "configs" / "k8s.yaml")
    host, port = cfg.nats.url.split("//")[1].split(":")
    assert docs["Service"]["metadata"]["name"] == host
    assert [p["port"] for p in docs["Service"]["spec"]["ports"]] == [int(port)]


# -- NATS users and credentials (docs/operations.md, "The internal plane") ------------------

NATS_CONF = DEPLOY / "nats" / "nats-server.conf"


def _password_ref(role: str) -> str:
    return f"${{{password_var(role)}:?"


@pytest.mark.parametrize("cfg_name", ["compose.yaml", "k8s.yaml"])
def test_the_deploy_nats_config_is_generated_from_the_role_permissions(cfg_name: str) -> None:
    # regenerate: python -m services.launcher.nats_auth conf > deploy/nats/nats-server.conf
    namespace = load_config(ROOT / "configs" / cfg_name).namespace
    assert NATS_CONF.read_text() == render_conf(namespace, deploy_users())
    assert sorted(u.role for u in deploy_users()) == sorted(ROLES)


def test_the_deploy_nats_config_is_valid_and_names_every_password(tmp_path: Path) -> None:
    try:
        binary = find_nats_server()
    except NatsServerNotFoundError:
        pytest.skip("nats-server is not installed")
    env = {password_var(r): f"pw-{r}" for r in ROLES}
    out = subprocess.run([binary, "-c", str(NATS_CONF), "-t"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for role in ROLES:
        assert f"password: ${password_var(role)}," in NATS_CONF.read_text()


def test_compose_gives_every_part_its_role_user_and_secret_files(compose: dict) -> None:
    services = compose["services"]
    made = DeploySecrets.fresh().files("tandem")
    for part in (*TANDEM_PARTS, "encode", "planner"):
        svc = services[part]
        assert svc["user"] == str(ROLE_UIDS[part])
        environ = svc["environment"]
        assert environ["TANDEM_NATS_USER"] == part
        if part == "planner":  # it calls no part's gRPC: no cluster token
            assert environ["TANDEM_NATS_PASSWORD_FILE"] == "/secrets/planner/nats_password"
            assert "TANDEM_CLUSTER_TOKEN_FILE" not in environ and svc["profiles"] == ["planner"]
            _check_tandem_command(svc["command"], "planner", "/etc/tandem/cluster.yaml")
            continue
        assert not any(k in environ for k in ("TANDEM_NATS_PASSWORD", "TANDEM_CLUSTER_TOKEN"))
        for var, name in (("TANDEM_NATS_PASSWORD_FILE", "nats_password"),
                          ("TANDEM_CLUSTER_TOKEN_FILE", "cluster_token")):
            path = environ[var]
            assert path == f"/secrets/{part}/{name}"
            assert made[path.removeprefix("/secrets/")][0] == ROLE_UIDS[part]
        assert "secrets:/secrets:ro" in svc["volumes"]
        assert svc["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}
    assert services["frontend"]["environment"]["TANDEM_API_KEYS_FILE"] == "/secrets/frontend/api_keys"
    nats = services["nats"]
    conf = nats["command"][nats["command"].index("-c") + 1]
    assert conf == "/secrets/nats/nats-server.conf" and made["nats/nats-server.conf"][0] == 0
    # who mounts the secrets: the parts, NATS, Grafana and the service that makes them
    mounting = {name for name, svc in services.items()
                if any(v.split(":")[0] == "secrets" for v in svc.get("volumes", []))}
    assert mounting == {*TANDEM_PARTS, "encode", "planner", "nats", "grafana", "secrets"}
    assert services["secrets"]["restart"] == "no" and services["secrets"]["user"] == "0"


def test_the_hostnet_override_puts_every_service_on_the_host_network(compose: dict) -> None:
    over = yaml.load((DEPLOY / "compose.hostnet.yaml").read_text(), _ComposeLoader)["services"]
    assert set(over) == set(compose["services"])
    for name, svc in over.items():
        assert svc["network_mode"] == "host", name
        # published ports mean nothing on the host's network
        assert over[name].get("ports", "!reset") == "!reset", name
    hostnet_cfg = load_config(ROOT / "configs" / "compose-hostnet.yaml")
    bridge_cfg = load_config(ROOT / "configs" / "compose.yaml")
    # the same cluster on loopback: only the addresses differ
    same = {"nats", "bind_host", "decode", "encode"}
    a, b = hostnet_cfg.model_dump(), bridge_cfg.model_dump()
    assert {k: v for k, v in a.items() if k not in same} == {k: v for k, v in b.items() if k not in same}
    assert hostnet_cfg.nats.url == "nats://127.0.0.1:4222" and hostnet_cfg.bind_host == "127.0.0.1"
    assert hostnet_cfg.decode.advertise_host == "127.0.0.1"
    for part in TANDEM_PARTS:
        assert over[part]["volumes"] == ["../configs/compose-hostnet.yaml:/etc/tandem/cluster.yaml:ro"]
    for part in ("decode", "encode"):  # loopback is the address to publish
        assert parse_slot_args(over[part]["command"][3:]).advertise_ip is None
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-hostnet.yml").read_text())
    assert _scrape_targets(prom) == _metrics_targets("compose-hostnet.yaml", "127.0.0.1")
    assert "--web.listen-address=127.0.0.1:9090" in over["prometheus"]["command"]


def test_the_gpu_override_reserves_a_gpu_per_worker_and_runs_the_engine_on_cuda() -> None:
    over = yaml.safe_load((DEPLOY / "compose.gpu.yaml").read_text())["services"]
    assert set(over) == {"decode", "prefill"}
    for svc in over.values():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert svc["environment"]["TANDEM_PART_ARGS"] == "--set engine.device=cuda"


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_k8s_gives_every_part_its_role_user_from_the_secret(k8s: dict) -> None:
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    (gen,) = kust["secretGenerator"]
    secret = gen["name"]
    assert gen["envs"] == ["secrets.env"]
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "deploy/k8s/secrets.env" in ignored and "deploy/.env" in ignored
    for part in TANDEM_PARTS:
        (container,) = {d["kind"]: d for d in k8s[f"{part}.yaml"]}["Deployment"]["spec"]["template"][
            "spec"]["containers"]
        environ = _env(container)
        assert environ["TANDEM_NATS_USER"]["value"] == part
        assert environ["TANDEM_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": secret, "key": password_var(part)}
        assert environ["TANDEM_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": secret, "key": "TANDEM_CLUSTER_TOKEN"}
    front = _env({d["kind"]: d for d in k8s["frontend.yaml"]}["Deployment"]["spec"]["template"]["spec"][
        "containers"][0])
    assert front["TANDEM_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": secret, "key": "TANDEM_API_KEYS", "optional": True}


def test_k8s_nats_requires_the_generated_users(k8s: dict) -> None:
    (cm,) = k8s["nats-config.yaml"]
    assert cm["data"]["nats-server.conf"] == NATS_CONF.read_text()
    pod = {d["kind"]: d for d in k8s["nats.yaml"]}["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    conf = Path(container["args"][container["args"].index("-c") + 1])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(conf.parent))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == cm["metadata"]["name"] and conf.name in cm["data"]
    secret = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["secretGenerator"][0]["name"]
    assert {k: v["valueFrom"]["secretKeyRef"] for k, v in _env(container).items()} == {
        password_var(r): {"name": secret, "key": password_var(r)} for r in ROLES}


def test_k8s_planner_runs_tandem_planner_and_may_scale_the_worker_deployments_alone(k8s: dict) -> None:
    cfg = load_config(ROOT / "configs" / "k8s.yaml")
    pc = cfg.planner
    assert pc.actuator == "kubernetes"
    docs = {d["kind"]: d for d in k8s["planner.yaml"]}
    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    _check_tandem_command(container["command"], "planner", "/etc/tandem/cluster.yaml")
    assert docs["Deployment"]["spec"]["replicas"] == 1
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": pc.metrics_port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(pc.metrics_port)
    assert _env(container)["TANDEM_NATS_USER"]["value"] == "planner"
    # the service account, bound to a Role that reaches the two Deployments' scale alone
    account = docs["ServiceAccount"]["metadata"]["name"]
    assert pod["spec"]["serviceAccountName"] == account
    binding = docs["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
    (rule,) = docs["Role"]["rules"]
    assert rule["resources"] == ["deployments/scale"] and rule["apiGroups"] == ["apps"]
    assert sorted(rule["resourceNames"]) == sorted([pc.k8s_prefill_deployment, pc.k8s_decode_deployment])
    assert {"get", "patch"} <= set(rule["verbs"]) and "delete" not in rule["verbs"]
    names = {d["metadata"]["name"] for f in ("prefill.yaml", "decode.yaml") for d in k8s[f]
             if d["kind"] == "Deployment"}
    assert names == set(rule["resourceNames"])


def test_k8s_worker_pods_take_their_pod_name_as_instance_id_so_their_deployments_scale(k8s: dict) -> None:
    for part in ("decode", "prefill"):
        (container,) = {d["kind"]: d for d in k8s[f"{part}.yaml"]}["Deployment"]["spec"]["template"][
            "spec"]["containers"]
        assert _env(container)["TANDEM_INSTANCE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
