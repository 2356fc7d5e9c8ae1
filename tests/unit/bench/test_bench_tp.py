"""`tandem bench tp`: the figures from a hand-made run record (which gaps count as arrival
gaps, TTFT from the scheduled arrival), the mixed requests, and the arrival loop on tiny
models at TP=1 and TP=2 (both broadcast modes, a payload or a LLaVA image riding with the
heavy requests): every request runs to its end and the figures add up to what ran."""

from __future__ import annotations

from dataclasses import astuple
from pathlib import Path

import pytest

from services.bench.metrics import Dist
from services.bench.tp import model_shape, parse_sizes, run_mix, split_problem
from services.bench.tp_mix import MixSpec, make_mix
from services.bench.tp_streams import RunRecord, figures
from services.common.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.runner.torch_runner import TorchRunner
from services.engine.tp.runner import TpRunner
from services.engine.weights import load_weights
from tests.support.tiny_model import tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", seed=5)[0].save_pretrained(out, safe_serialization=True)
    return out


def _cfg(tp: int, mode: str = "async") -> EngineConfig:
    # overlap off, as the bench runs (one token per chunk, read back in its own step)
    return EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128, max_num_seqs=8,
                        overlap=False, tensor_parallel_size=tp, tp_broadcast=mode, tp_timeout_s=120)


SPEC = MixSpec(requests=8, rate=400.0, short_len=5, long_len=24, long_share=0.5, heavy_share=0.5,
               payload_kib=64, output_len=4)


def test_figures_split_gaps_by_arrivals_inside_them() -> None:
    rec = RunRecord(
        step_end_s=[0.10, 0.20, 0.35, 0.40, 0.60],
        step_arrivals=[1, 0, 1, 0, 0],
        arrival_s={"a": 0.0, "b": 0.15},
        # a: a token every step; its gap into step 2 holds b's arrival, the gap out of it
        # does not. b: added in step 2's turn, skips step 3.
        chunks={"a": [(0, 1), (1, 1), (2, 1), (3, 1)], "b": [(2, 1), (4, 1)]},
        add_s=0.004,
    )
    f = figures(rec)
    assert astuple(f.itl_quiet) == pytest.approx(astuple(Dist.of([100.0, 50.0, 250.0])))
    assert astuple(f.itl_arrival) == pytest.approx(astuple(Dist.of([150.0])))
    # b's TTFT from its scheduled arrival at 0.15 s, not from the turn that added it
    assert astuple(f.ttft) == pytest.approx(astuple(Dist.of([100.0, 200.0])))
    assert (f.output_tokens, f.arrivals, f.arrival_steps, f.steps) == (6, 2, 2, 5)
    assert f.output_tok_s == pytest.approx(10.0) and f.duration_s == 0.60
    assert f.add_ms_per_arrival == pytest.approx(2.0)


def test_run_record_refuses_mismatched_steps() -> None:
    with pytest.raises(ValueError, match="step"):
        RunRecord([0.1, 0.2], [1], {}, {}, 0.0)


def test_mix_is_the_same_for_the_same_spec() -> None:
    a, b = make_mix(SPEC, 200), make_mix(SPEC, 200)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert a.offsets == b.offsets and a.heavy == b.heavy and a.payload == b.payload
    assert a.offsets[0] == 0.0 and a.offsets == sorted(a.offsets)
    assert len(a.payload) == 64 * 1024
    for r in a.requests:
        assert len(r.prompt_token_ids) == (24 if "-long" in r.request_id else 5)
        assert (r.request_id in a.heavy) == r.request_id.endswith("-heavy")
        assert r.images == ()  # a text model: the heavy ones carry the payload instead
    # exact shares, placed independently
    assert len(a.heavy) == 4 and sum("-long" in r.request_id for r in a.requests) == 4
    with pytest.raises(ValueError, match="long_share"):
        MixSpec(1, 1.0, 1, 1, 1.5, 0, 0, 1)


def test_sizes_and_splits(tiny: Path) -> None:
    assert parse_sizes("3,1,2,1") == [1, 2, 3]
    for bad in ("1,x", "0"):
        with pytest.raises(ValueError, match="--tp"):
            parse_sizes(bad)
    arch, image = model_shape(tiny)
    assert image is None
    assert split_problem(arch, 1) is None and split_problem(arch, 2) is None
    assert "4 attention heads" in (split_problem(arch, 3) or "")  # 4 heads, 2 KV heads


def _check(engine: LLMEngine, spec: MixSpec, rec: RunRecord) -> None:
    f = figures(rec)
    assert f.arrivals == spec.requests and sum(rec.step_arrivals) == spec.requests
    assert all(sum(n for _, n in c) == spec.output_len for c in rec.chunks.values())
    assert f.output_tokens == spec.requests * spec.output_len
    # One token per chunk (no overlap, n = 1): every later token is one gap, in one class.
    assert f.itl_quiet.count + f.itl_arrival.count == spec.requests * (spec.output_len - 1)
    assert f.ttft.count == spec.requests and f.ttft.p50 <= f.ttft.p99
    for d in (f.itl_quiet, f.itl_arrival):
        assert d.count == 0 or 0 < d.p50 <= d.p99
    assert rec.step_end_s == sorted(rec.step_end_s) and f.steps == len(rec.step_end_s)
    assert 1 <= f.arrival_steps <= f.arrivals
    for rid, chunks in rec.chunks.items():  # a first token comes after its request's arrival
        assert rec.step_end_s[chunks[0][0]] > rec.arrival_s[rid]
    assert f.output_tok_s == pytest.approx(f.output_tokens / f.duration_s)
    assert engine.stats().kv_blocks_used == 0


def test_tp1_baseline_runs_the_mix(tiny: Path) -> None:
    loaded = load_weights(tiny)
    runner = TorchRunner(loaded.arch, loaded.tensors, _cfg(1))
    engine = LLMEngine(runner, _cfg(1), eos_token_ids=[0])
    try:
        _check(engine, SPEC, run_mix(engine, make_mix(SPEC, runner.vocab_size)))
    finally:
        runner.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tp2_runs_the_mix_with_payloads(tiny: Path, mode: str) -> None:
    loaded = load_weights(tiny)
    runner = TpRunner(loaded.arch, loaded.tensors, _cfg(2, mode), tiny)
    engine = LLMEngine(runner, _cfg(2, mode), eos_token_ids=[0])
    try:
        mix = make_mix(SPEC, runner.vocab_size)
        _check(engine, SPEC, run_mix(engine, mix))
        assert runner.broadcaster.sent == SPEC.requests  # every request's payload reached the rank
        heavy = [r.request_id in mix.heavy for r in mix.requests]
        assert [runner.extra_payload(r) == mix.payload for r in mix.requests] == heavy  # only they carry it
    finally:
        runner.close()


def test_tp2_llava_sends_images_with_the_heavy_requests(tmp_path: Path) -> None:
    from services.engine.multimodal.weights import load_llava_dir
    from tests.support.tiny_llava import save_tiny_llava, tiny_llava

    path = save_tiny_llava(tiny_llava("clip", "llama"), tmp_path / "llava")
    arch, image = model_shape(path)
    assert image is not None and image.hidden == arch.hidden_size
    w = load_llava_dir(path)
    runner = TpRunner(w.text.arch, w.text.tensors, _cfg(2), path)
    engine = LLMEngine(runner, _cfg(2), eos_token_ids=[])
    try:
        mix = make_mix(SPEC, runner.vocab_size, image, runner.dtype)
        assert mix.payload == b""
        for r in mix.requests:
            assert len(r.images) == (r.request_id in mix.heavy)
            for span in r.images:
                assert r.prompt_token_ids[span.offset:span.end] == [image.token_id] * image.rows
                assert span.embeds is not None and tuple(span.embeds.shape) == (image.rows, image.hidden)
        _check(engine, SPEC, run_mix(engine, mix))
        assert runner.broadcaster.sent == SPEC.requests
    finally:
        runner.close()
