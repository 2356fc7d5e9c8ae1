"""Penalties, logit_bias, min_tokens and logprobs: the sampler's processed logits equal a
plain per-row reference, rows that ask for nothing are untouched, and the engine's tokens
and logprobs (overlap on and off, with preemption) equal a full-recompute Hugging Face
reference that applies the same rules."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from services.api.outputs import FinishReason, TokenLogprob
from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.batch import PenaltyInit
from services.engine.engine import LLMEngine
from services.engine.logits_process import LogitsProcessor
from services.engine.request import GenerateRequest
from services.engine.runner.torch_runner import TorchRunner
from services.engine.sampler import Sampler
from services.engine.weights import load_weights
from tests.support.tiny_model import seq, tiny_hf_model

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


def test_a_banned_token_reports_a_finite_logprob() -> None:
    """A top-k past the allowed tokens names banned ones: -9999, not -inf (no JSON for it)."""
    logits = torch.zeros(1, 4)
    row = seq("a", [1], 0, [0], sampling=SamplingParams(temperature=0, logprobs=4))
    row.banned_ids = (0, 1, 2)
    lp = Sampler(0).sample_tensor(logits, [row]).token_logprobs([row])[0]
    assert lp.token_id == 3 and lp.logprob == pytest.approx(0.0)
    assert [x for _, x in lp.top][1:] == [-9999.0] * 3


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


# ---- n choices ------------------------------------------------------------------------------

def _tiny_engine(tmp_path: Path, overlap: bool, **cfg_kw) -> LLMEngine:
    model, _ = tiny_hf_model("llama", seed=4)
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_weights(tmp_path)
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, overlap=overlap,
                       **{"num_kv_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 32,
                          **cfg_kw})
    return LLMEngine(TorchRunner(loaded.arch, loaded.tensors, cfg), cfg, eos_token_ids=[0])


def _drain(engine: LLMEngine) -> dict[tuple[str, int], tuple[list[int], FinishReason | None]]:
    got: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], FinishReason | None] = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            got.setdefault((o.request_id, o.index), []).extend(o.token_ids)
            if o.finished:
                assert (o.request_id, o.index) not in reasons
                reasons[(o.request_id, o.index)] = o.finish_reason
        engine.check_integrity()
    assert not engine.has_unfinished()
    assert engine.stats().kv_blocks_used == 0
    return {k: (v, reasons.get(k)) for k, v in got.items()}


@pytest.mark.parametrize("overlap", [False, True])
def test_n_choices_fork_after_one_prefill_and_equal_single_requests(tmp_path: Path,
                                                                    overlap: bool) -> None:
    """n=4 with a seed: choice i equals an n=1 request seeded for_choice(i) (the fork's recomputed
    tail gives the same first-token logits); the prompt is counted once; every block and
    penalty slot comes back; the same request again gives the same choices."""
    prompt = [(i * 29 + 7) % 120 + 2 for i in range(18)]  # 4 full blocks + 2 tokens
    sp = SamplingParams(temperature=1.0, seed=41, max_tokens=9, n=4, ignore_eos=True,
                        frequency_penalty=0.5, logprobs=1)
    engine = _tiny_engine(tmp_path, overlap)
    engine.add_request(GenerateRequest("multi", prompt, sp))
    before = engine.stats().prompt_tokens_total
    multi = _drain(engine)
    assert engine.stats().prompt_tokens_total - before == len(prompt), "the prompt is counted once"
    assert sorted(multi) == [("multi", i) for i in range(4)]
    assert all(r == FinishReason.LENGTH and len(t) == 9 for t, r in multi.values())
    assert len({tuple(t) for t, _ in multi.values()}) > 1, "choices differ"

    for i in range(4):
        engine.add_request(GenerateRequest(f"one{i}", prompt, sp.for_choice(i)))
    singles = _drain(engine)
    for i in range(4):
        assert multi[("multi", i)][0] == singles[(f"one{i}", 0)][0], i

    engine.add_request(GenerateRequest("again", prompt, sp))
    again = _drain(engine)
    assert [again[("again", i)][0] for i in range(4)] == [multi[("multi", i)][0] for i in range(4)]
    sched = engine.scheduler
    assert sorted(sched._free_penalty_slots) == list(range(sched._next_penalty_slot))


def test_aborting_an_n_request_frees_every_choice(tmp_path: Path) -> None:
    engine = _tiny_engine(tmp_path, overlap=True)
    prompt = list(range(2, 23))
    engine.add_request(GenerateRequest("x", prompt, SamplingParams(temperature=0.7, n=3, max_tokens=50,
                                                                   ignore_eos=True)))
    seen: set[int] = set()
    for _ in range(6):
        for o in engine.step():
            seen.add(o.index)
        engine.check_integrity()
    assert seen == {0, 1, 2} and len(engine.scheduler.live_sequences()) == 3
    out = engine.abort("x")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert not engine.scheduler.has_unfinished() and engine.scheduler.live_sequences() == []
    for _ in range(3):  # the batch in flight is read back and dropped
        assert all(o.request_id != "x" for o in engine.step())
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0


def test_n_choices_under_preemption(tmp_path: Path) -> None:
    """A pool too small for every choice at once: choices are preempted and recomputed,
    and still equal their single-request twins (greedy with penalties)."""
    prompt = [(i * 13 + 5) % 120 + 2 for i in range(14)]
    sp = SamplingParams(temperature=0, max_tokens=12, n=3, ignore_eos=True,
                        presence_penalty=1.0, logit_bias=((11, 1.5),))
    engine = _tiny_engine(tmp_path, overlap=True, num_kv_blocks=14)
    engine.add_request(GenerateRequest("m", prompt, sp))
    multi = _drain(engine)
    assert engine.stats().num_preemptions_total > 0
    engine.add_request(GenerateRequest("s", prompt, sp.for_choice(0)))
    single = _drain(engine)[("s", 0)][0]
    assert all(multi[("m", i)][0] == single for i in range(3))  # greedy: all the same


async def test_closing_an_n_stream_early_aborts_every_choice() -> None:
    """The caller goes away (the gRPC call is cancelled) after a few outputs of an n=4
    request: every choice is aborted and every block comes back."""
    import asyncio

    from services.engine.async_engine import AsyncEngine
    from services.engine.runner.mock_runner import MockRunner
    from tests.support.mock_cluster import mock_cluster_cfg

    # 20 ms steps: choices left running would hold their blocks for seconds.
    cfg = mock_cluster_cfg(engine={"mock": {"step_base_s": 0.02}})
    async with AsyncEngine(LLMEngine(MockRunner(cfg.engine), cfg.engine, [2])) as ae:
        sp = SamplingParams(max_tokens=400, n=4, ignore_eos=True)
        seen: set[int] = set()
        outs = ae.generate(GenerateRequest("gone", list(range(5, 60)), sp))
        async for o in outs:
            seen.add(o.index)
            if len(seen) == 4:
                break
        await outs.aclose()
        for _ in range(200):
            if ae.stats().kv_blocks_used == 0 and ae.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert ae.stats().kv_blocks_used == 0 and ae.stats().num_running == 0
        await ae.check_integrity()
