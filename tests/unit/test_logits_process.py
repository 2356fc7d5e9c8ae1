"""Penalties, logit_bias, min_tokens and logprobs: the sampler's processed logits equal a
plain per-row reference, rows that ask for nothing are untouched, and the engine's tokens
and logprobs (overlap on and off, with preemption) equal a full-recompute Hugging Face
reference that applies the same rules."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from services.common.config import EngineConfig
from services.engine.batch import PenaltyInit
from services.engine.engine import LLMEngine
from services.engine.logits_process import LogitsProcessor
from services.engine.request import FinishReason, GenerateRequest, SamplingParams, TokenLogprob
from services.engine.runner.torch_runner import TorchRunner
from services.engine.sampler import Sampler
from services.engine.weights import load_weights
from tests.unit._tiny_model import seq, tiny_hf_model

V = 32


def reference(logits: torch.Tensor, prompt: list[int], produced: list[int], sp: SamplingParams,
              stops: set[int]) -> torch.Tensor:
    """One row's processed logits, token by token (vLLM's/OpenAI's definitions)."""
    out = logits.clone().double()
    counts = Counter(produced)
    for t in set(prompt) | set(produced):
        x = out[t]
        out[t] = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
    for t, c in counts.items():
        out[t] -= sp.frequency_penalty * c + sp.presence_penalty
    for t, b in sp.logit_bias:
        out[t] += b
    if len(produced) < sp.min_tokens:
        for t in stops:
            out[t] = float("-inf")
    return out.float()


def test_processed_rows_equal_the_reference_and_other_rows_are_untouched() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=gen) * 3
    pen = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6,
                         logit_bias=((3, 5.0), (9, -100.0)), min_tokens=5)
    bias_only = SamplingParams(logit_bias=((1, 2.5),))
    prompt, produced = [4, 5, 6, 4], [7, 7, 8, 5]
    rows = [
        seq("a", [8], 8, [0], sampling=pen, num_generated=4),
        seq("b", [1], 3, [0]),
        seq("c", [1], 3, [0], sampling=bias_only),
        seq("d", [2], 9, [0], sampling=SamplingParams(frequency_penalty=-1.0), num_generated=2),
    ]
    rows[0].penalty_slot, rows[0].penalty_init = 5, PenaltyInit(tuple(prompt), tuple(produced))
    rows[0].banned_ids = (0, 2)
    rows[3].penalty_slot, rows[3].penalty_init = 0, PenaltyInit((1,), (2, 2))
    proc = LogitsProcessor(torch.device("cpu"))
    got = proc.apply(logits, rows)

    assert torch.allclose(got[0], reference(logits[0], prompt, produced, pen, {0, 2}))
    assert torch.equal(got[1], logits[1])  # asks for nothing
    assert torch.allclose(got[2], reference(logits[2], [], [], bias_only, set()))
    fp = SamplingParams(frequency_penalty=-1.0)
    assert torch.allclose(got[3], reference(logits[3], [1], [2, 2], fp, set()))

    # Counts grow on the device from what was sampled; the init is not repeated.
    for r in rows:
        r.penalty_init = None
    rows[0].banned_ids = ()  # min_tokens reached: the scheduler bans nothing any more
    proc.record(torch.tensor([7, 1, 1, 2]), rows)
    again = proc.apply(logits, rows)
    assert torch.allclose(again[0], reference(logits[0], prompt, [*produced, 7], pen, {0, 2}))
    assert torch.allclose(again[3], reference(logits[3], [1], [2, 2, 2], fp, set()))


def test_no_rule_costs_nothing_and_keeps_the_tensor() -> None:
    logits = torch.randn(3, V)
    rows = [seq(f"{i}", [1], 0, [0]) for i in range(3)]
    assert LogitsProcessor(torch.device("cpu")).apply(logits, rows) is logits


def test_logprobs_are_log_softmax_of_processed_logits_before_temperature() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2)) * 2
    sp = SamplingParams(temperature=0.7, logprobs=4, logit_bias=((5, 3.0),), seed=3)
    rows = [seq("a", [1], 0, [0], sampling=sp), seq("b", [1], 0, [0]),
            seq("c", [1], 0, [0], sampling=SamplingParams(temperature=0, logprobs=0))]
    out = Sampler(1).sample_tensor(logits, rows)
    lps = out.token_logprobs(rows)
    assert lps is not None and lps[1] is None
    ref0 = torch.log_softmax(reference(logits[0], [], [], sp, set()), -1)
    tok0 = int(out.tokens[0])
    assert lps[0] == TokenLogprob(tok0, pytest.approx(float(ref0[tok0]), abs=1e-5), lps[0].top)
    assert [t for t, _ in lps[0].top] == ref0.topk(4).indices.tolist()
    assert [lp for _, lp in lps[0].top] == pytest.approx(ref0.topk(4).values.tolist(), abs=1e-5)
    ref2 = torch.log_softmax(logits[2], -1)
    assert lps[2].token_id == int(logits[2].argmax()) and lps[2].top == ()
    assert lps[2].logprob == pytest.approx(float(ref2.max()), abs=1e-5)


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")), dict(repetition_penalty=0.0),
    dict(logit_bias=((3, 1.0), (2, 1.0))), dict(logit_bias=((3, 101.0),)), dict(min_tokens=-1),
    dict(logprobs=21), dict(logprobs=-1),
])
def test_bad_values_name_their_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


# ---- the engine against a full-recompute reference -----------------------------------------

EOS = 0


@torch.inference_mode()
def _reference(model, prompt: list[int], sp: SamplingParams, eos: int
               ) -> tuple[list[int], list[float]]:
    """Greedy tokens and chosen-token logprobs under the rules, recomputing everything."""
    toks, lps = list(prompt), []
    assert sp.max_tokens is not None
    for _ in range(sp.max_tokens):
        raw = model(torch.tensor([toks])).logits[0, -1].float()
        stops = {eos, *sp.stop_token_ids}
        proc = reference(raw, prompt, toks[len(prompt):], sp, stops)
        t = int(proc.argmax())
        lps.append(float(torch.log_softmax(proc, -1)[t]))
        toks.append(t)
        if t in stops:
            break
    return toks[len(prompt):], lps


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_with_penalties_equals_the_reference(tmp_path: Path, overlap: bool) -> None:
    model, _ = tiny_hf_model("llama", seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_weights(tmp_path)
    gen = torch.Generator().manual_seed(5)
    kinds = [
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=0.8, logprobs=3),
        SamplingParams(repetition_penalty=1.8, logprobs=0),
        SamplingParams(logit_bias=((7, 4.0), (9, -50.0)), logprobs=1),
        SamplingParams(min_tokens=6, presence_penalty=-0.5),
        SamplingParams(),  # no rule: shares the batches
    ]
    reqs = []
    for i in range(12):
        prompt = torch.randint(1, 128, (int(torch.randint(3, 18, (1,), generator=gen)),),
                               generator=gen).tolist()
        base = kinds[i % len(kinds)]
        sp = SamplingParams(temperature=0, max_tokens=int(torch.randint(5, 12, (1,), generator=gen)),
                            presence_penalty=base.presence_penalty,
                            frequency_penalty=base.frequency_penalty,
                            repetition_penalty=base.repetition_penalty, logit_bias=base.logit_bias,
                            min_tokens=base.min_tokens, logprobs=base.logprobs)
        reqs.append(GenerateRequest(f"r{i}", prompt, sp))
    # min_tokens must matter: EOS is what the reference picks first without it.
    free_first = _reference(model, reqs[4].prompt_token_ids,
                            SamplingParams(temperature=0, max_tokens=1), -1)[0][0]
    eos = free_first
    expected = {r.request_id: _reference(model, r.prompt_token_ids, r.sampling, eos) for r in reqs}
    assert len(expected["r4"][0]) >= 6

    # A small pool forces preemption: penalty slots must survive it.
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=14,
                       max_num_seqs=5, max_num_batched_tokens=16, overlap=overlap)
    engine = LLMEngine(TorchRunner(loaded.arch, loaded.tensors, cfg), cfg, eos_token_ids=[eos])
    for r in reqs:
        engine.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    got_lps: dict[str, list[TokenLogprob]] = {r.request_id: [] for r in reqs}
    reasons: dict[str, FinishReason | None] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
            if out.logprobs is not None:
                got_lps[out.request_id].extend(out.logprobs)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        assert steps < 2000
    for r in reqs:
        toks, lps = expected[r.request_id]
        assert got[r.request_id] == toks, r.request_id
        k = r.sampling.logprobs
        if k is None:
            assert got_lps[r.request_id] == []
            continue
        assert [lp.token_id for lp in got_lps[r.request_id]] == toks
        assert [lp.logprob for lp in got_lps[r.request_id]] == pytest.approx(lps, abs=1e-4)
        assert all(len(lp.top) == k for lp in got_lps[r.request_id])
        assert all(lp.top[0][0] == lp.token_id for lp in got_lps[r.request_id] if k)
    assert engine.stats().num_preemptions_total > 0, "the pool should force preemption"
    assert engine.stats().kv_blocks_used == 0
    sched = engine.scheduler
    assert sched._next_penalty_slot > 0
    assert sorted(sched._free_penalty_slots) == list(range(sched._next_penalty_slot)), \
        "every finished request gives its penalty slot back"
