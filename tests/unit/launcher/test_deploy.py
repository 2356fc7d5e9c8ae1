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
from services.launcher.nats import NatsServerNotFoundError, find_nats_server
from services.launcher.nats_auth import deploy_users, password_var, render_conf
from services.launcher.plan import plan

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
    "tandem_worker_request_queue_seconds",
    "tandem_worker_request_prefill_seconds",
    "tandem_worker_request_decode_seconds",
    "tandem_worker_grammar_compile_seconds",
    "tandem_worker_grammar_mask_fill_seconds",
    "tandem_worker_structured_requests_total",
    "tandem_worker_grammar_errors_total",
    "tandem_router_decisions_total",
    "tandem_router_route_seconds",
}


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


# -- compose --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())


def test_compose_services_run_real_tandem_subcommands(compose: dict) -> None:
    services = compose["services"]
    assert set(TANDEM_PARTS) | {"nats", "prometheus", "grafana"} <= set(services)
    for part in TANDEM_PARTS:
        svc = services[part]
        mount = next(v for v in svc["volumes"] if v.startswith("../configs/compose.yaml:"))
        target = mount.split(":")[1]
        assert (DEPLOY / mount.split(":")[0]).resolve() == ROOT / "configs" / "compose.yaml"
        _check_tandem_command(svc["command"], part, target)
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
    assert "-js" in services["nats"]["command"] and services["nats"]["image"].startswith("nats:2.10")


def test_compose_ports_match_the_config(compose: dict) -> None:
    cfg = load_config(ROOT / "configs" / "compose.yaml")
    ports = _part_ports("compose.yaml")
    services = compose["services"]
    for part in ("router", "decode", "prefill", "processor"):
        assert sorted(int(p) for p in services[part]["expose"]) == sorted(ports[part].values())
    assert services["frontend"]["ports"] == [f"{cfg.frontend.port}:{cfg.frontend.port}"]
    assert services["nats"]["expose"] == [str(int(cfg.nats.url.rsplit(":", 1)[1]))]
    assert cfg.nats.url.split("//")[1].split(":")[0] == "nats"
    assert cfg.decode.advertise_host == "decode" and services["decode"]["hostname"] == "decode"


def test_compose_runs_a_second_router_replica_as_replica_1(compose: dict) -> None:
    ports = _part_ports("compose.yaml")["router"]
    services = compose["services"]
    one, first = services["router-1"], services["router"]
    args = build_parser().parse_args(one["command"][1:])
    assert args._key == ("router",) and args.replica == 1
    assert one["command"][:-1] == first["command"][:-1]
    assert sorted(int(p) for p in one["expose"]) == sorted(p + 1 for p in ports.values())
    assert one["hostname"] == "router-1" and one["environment"] == first["environment"]
    assert one["volumes"] == first["volumes"]


def test_prometheus_scrapes_every_part_on_its_metrics_port(compose: dict) -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    ports = _part_ports("compose.yaml")
    want = {f"{part}:{ports[part]['metrics' if part != 'frontend' else 'http']}" for part in TANDEM_PARTS}
    want.add(f"router-1:{ports['router']['metrics'] + 1}")  # the second router replica
    assert targets == want
    mount = next(v for v in compose["services"]["prometheus"]["volumes"] if "prometheus.yml" in v)
    assert (DEPLOY / mount.split(":")[0]).resolve() == DEPLOY / "prometheus" / "prometheus.yml"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard(compose: dict) -> None:
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tandem.yaml").read_text())
    dash_dir = prov["providers"][0]["options"]["path"]
    mounts = dict(v.split(":")[:2][::-1] for v in compose["services"]["grafana"]["volumes"])
    assert (DEPLOY / mounts[dash_dir]).resolve() == DEPLOY / "grafana" / "dashboards"
    uid = ds["datasources"][0]["uid"]
    dash = json.loads((DEPLOY / "grafana/dashboards/tandem.json").read_text())
    assert all(p["datasource"]["uid"] == uid for p in dash["panels"])


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


def test_dockerfile_installs_cpu_torch_then_the_package_then_the_model() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    steps = [line for line in text.splitlines() if line.startswith("RUN ")]
    assert steps[0] == "RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert steps.index("RUN pip install .") < steps.index("RUN tandem model pull")


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


def test_k8s_runs_a_second_router_replica_as_replica_1(k8s: dict) -> None:
    ports = _part_ports("k8s.yaml")["router"]
    first = {d["kind"]: d for d in k8s["router.yaml"]}
    docs = {d["kind"]: d for d in k8s["router-1.yaml"]}
    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    (first_container,) = first["Deployment"]["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["command"][1:])
    assert args._key == ("router",) and args.replica == 1
    assert container["command"][:-1] == first_container["command"][:-1]
    assert container["env"] == first_container["env"]
    want = {label: port + 1 for label, port in ports.items()}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == want
    assert {p["name"]: p["port"] for p in docs["Service"]["spec"]["ports"]} == want
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(want["metrics"])
    labels = docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert pod["metadata"]["labels"] == labels == docs["Service"]["spec"]["selector"]
    # selectors apart: neither Deployment nor Service takes the other replica's pods
    assert labels != first["Deployment"]["spec"]["selector"]["matchLabels"]


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


def test_compose_gives_every_part_its_role_user_and_nats_the_passwords(compose: dict) -> None:
    services = compose["services"]
    for part in TANDEM_PARTS:
        environ = services[part]["environment"]
        assert environ["TANDEM_NATS_USER"] == part
        assert environ["TANDEM_NATS_PASSWORD"].startswith(_password_ref(part))
        assert environ["TANDEM_CLUSTER_TOKEN"].startswith("${TANDEM_CLUSTER_TOKEN:?")
    assert services["frontend"]["environment"]["TANDEM_API_KEYS"] == "${TANDEM_API_KEYS:-}"
    nats = services["nats"]
    assert {k: v.split(":?")[0] + ":?" for k, v in nats["environment"].items()} == {
        password_var(r): _password_ref(r) for r in ROLES}
    conf = nats["command"][nats["command"].index("-c") + 1]
    mount = next(v for v in nats["volumes"] if v.split(":")[1] == conf)
    assert (DEPLOY / mount.split(":")[0]).resolve() == NATS_CONF


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
