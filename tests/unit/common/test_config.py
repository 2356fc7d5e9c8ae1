from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[3]


def test_local_yaml_validates_with_design_keys() -> None:
    cfg = load_config(ROOT / "configs" / "local.yaml")
    assert cfg.namespace == "tandem"
    assert cfg.engine.block_size == 16 and cfg.engine.max_num_batched_tokens == 1024
    assert cfg.router.mode == "kv"
    assert cfg.decode.disagg.max_local_prefill_length == 256


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"engine\.blok_size"):
        parse_config({"engine": {"blok_size": 8}})


def test_bad_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"router\.mode"):
        parse_config({"router": {"mode": "fastest"}})


def test_overrides_apply_and_are_typed() -> None:
    cfg = parse_config({}, ["engine.threads=2", "router.mode=round_robin", "decode.disagg.enabled=false"])
    assert cfg.engine.threads == 2
    assert cfg.router.mode == "round_robin"
    assert cfg.decode.disagg.enabled is False
    with pytest.raises(ConfigError, match="key=value"):
        parse_config({}, ["engine.threads"])


def test_missing_file_is_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_discovery_heartbeat_must_be_shorter_than_ttl() -> None:
    import pytest

    from services.common.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="heartbeat_s"):
        parse_config({"discovery": {"ttl_s": 1, "heartbeat_s": 2}})
    assert parse_config({}).discovery.ttl_s > parse_config({}).discovery.heartbeat_s
