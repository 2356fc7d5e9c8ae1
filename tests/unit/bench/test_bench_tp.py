"""`tandem bench tp` on a tiny model: the burst runs every request to completion through
both broadcast modes and reports its figures; --tp auto picks a size the model splits."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.bench.tp import bench_burst, pick_tp
from services.common.config import EngineConfig, parse_config
from services.engine.engine import LLMEngine
from services.engine.tp.runner import TpRunner
from services.engine.weights import load_weights
from tests.support.tiny_model import tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", seed=5)[0].save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_burst_completes_and_reports(tiny: Path, mode: str) -> None:
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=8,
                       tensor_parallel_size=2, tp_broadcast=mode, tp_timeout_s=120)
    loaded = load_weights(tiny)
    runner = TpRunner(loaded.arch, loaded.tensors, cfg, tiny)
    engine = LLMEngine(runner, cfg, eos_token_ids=[0])
    out = bench_burst(engine, 30, 5, b"x" * 65536)
    assert runner.broadcaster.sent == 30  # every payload reached the rank
    assert out["steps"] >= 30 / 8 and out["admitted_req_s"] > 0
    assert out["step_p50_ms"] <= out["step_p99_ms"]
    assert 0 <= out["blocked_share"] < 1
    assert engine.stats().kv_blocks_used == 0


def test_pick_tp_auto_takes_the_smallest_size_the_model_splits(tiny: Path) -> None:
    cfg = parse_config({"model": {"path": str(tiny)}})
    assert pick_tp(cfg, "auto") == 2  # 4 heads, 2 KV heads
    assert pick_tp(cfg, "4") == 4
