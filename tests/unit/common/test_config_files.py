"""Every cluster YAML shipped in configs/ validates, and a typo in one is named."""

from pathlib import Path

import pytest
import yaml

from services.common.config import ConfigError, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))


def test_the_shipped_configs_are_there() -> None:
    names = {p.name for p in CONFIGS}
    assert {"local.yaml", "agg.yaml", "disagg.yaml", "compose.yaml", "k8s.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates(path: Path) -> None:
    load_config(path)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_bad_key_in_the_config_is_named(path: Path, tmp_path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    data["decode"] = {**data["decode"], "replicass": 2}
    bad = tmp_path / path.name
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"decode\.replicass"):
        load_config(bad)


def test_topologies() -> None:
    by_name = {p.name: load_config(p) for p in CONFIGS}
    local, agg, disagg = by_name["local.yaml"], by_name["agg.yaml"], by_name["disagg.yaml"]
    assert (local.decode.replicas, local.prefill.replicas, local.router.mode) == (1, 1, "kv")
    assert (agg.decode.replicas, agg.prefill.replicas, agg.decode.disagg.enabled) == (2, 0, False)
    assert (disagg.decode.replicas, disagg.prefill.replicas, disagg.decode.disagg.enabled) == (2, 2, True)
    for name in ("compose.yaml", "k8s.yaml"):
        cfg = by_name[name]
        assert cfg.nats.url == "nats://nats:4222" and not cfg.nats.embedded
        assert cfg.frontend.host == "0.0.0.0"
