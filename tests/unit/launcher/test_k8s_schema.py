"""deploy/k8s against the Kubernetes API schemas, offline (the schemas ship inside the
kubernetes-validate package), and the probes on each part's health endpoint."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
# the oldest Kubernetes still supported upstream when this was written, and the newest the
# package knows: a manifest valid in both is valid in between
VERSIONS = ("1.33.0", "1.37.0")
WORKERS = ("router", "decode", "prefill", "processor", "encode", "planner")


def _resources() -> list[tuple[str, dict]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [(name, doc) for name in kust["resources"]
            for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schema(version: str) -> None:
    docs = _resources()
    assert {d["kind"] for _, d in docs} == {"ConfigMap", "Deployment", "Service",
                                             "ServiceAccount", "Role", "RoleBinding"}  # the planner's
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


def test_the_validator_refuses_an_unknown_field() -> None:
    # strict mode is what catches a misspelt key (the mistake a YAML parse lets through)
    (_, deployment), *_ = [(n, d) for n, d in _resources() if d["kind"] == "Deployment"]
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[0], strict=True)


def _container(part: str) -> dict:
    docs = {d["kind"]: d for d in yaml.safe_load_all((K8S / f"{part}.yaml").read_text()) if d}
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def test_the_frontend_probes_its_health_endpoints() -> None:
    c = _container("frontend")
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}


@pytest.mark.parametrize("part", WORKERS)
def test_every_other_part_is_probed_on_its_metrics_endpoint(part: str) -> None:
    c = _container(part)
    ports = {p["name"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert c["startupProbe"]["tcpSocket"]["port"] == "metrics"
    # ready once its serving port is open (a prefill worker serves metrics alone)
    assert c["readinessProbe"]["tcpSocket"]["port"] == ("grpc" if "grpc" in ports else "metrics")


@pytest.mark.parametrize("part", ("frontend", *WORKERS))
def test_secrets_come_from_secret_objects_never_from_literals(part: str) -> None:
    env = {e["name"]: e for e in _container(part).get("env", [])}
    for name, e in env.items():
        if "PASSWORD" in name or "TOKEN" in name or "API_KEYS" in name:
            assert "value" not in e and "secretKeyRef" in e["valueFrom"], name
