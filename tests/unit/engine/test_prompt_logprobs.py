"""Prompt logprobs in the scheduler and the mock runner: every prompt position's logits are
computed (chunked or not, never taken from the prefix cache), the logprobs come once with
the request's first output, and ``max_tokens`` 0 computes the prompt only."""

from __future__ import annotations

from services.api.outputs import FinishReason, TokenOutput
from services.engine.engine import LLMEngine
from services.engine.runner.mock_runner import MockRunner
from services.engine.sampler import MIN_LOGPROB
from tests.support.engine_factory import make_engine, mock_cfg, req


def _prompt(runner: MockRunner) -> tuple[list[int], list[float]]:
    """A prompt whose tokens 3..9 are the mock model's own continuation (logprob 0) and the
    others are not (MIN_LOGPROB), with the logprobs expected for tokens 1..."""
    toks = [11, 12, 13]
    for _ in range(7):
        toks.append(runner.next_token(toks))
    toks += [runner.next_token(toks) + 1 for _ in range(1)]  # off the model's path
    toks += [500 + i for i in range(9)]
    want = [0.0 if toks[i] == runner.next_token(toks[:i]) else MIN_LOGPROB
            for i in range(1, len(toks))]
    assert want[2:9] == [0.0] * 7 and want[9] == MIN_LOGPROB
    return toks, want


def _run(eng: LLMEngine) -> list[TokenOutput]:
    outs: list[TokenOutput] = []
    for _ in range(200):
        if not eng.has_unfinished():
            return outs
        outs += eng.step()
        eng.check_integrity()
    raise AssertionError("engine did not finish")


def test_prompt_logprobs_of_a_chunked_prompt_come_with_the_first_token() -> None:
    eng, runner, _ = make_engine(mock_cfg(max_num_batched_tokens=8))
    toks, want = _prompt(runner)
    eng.add_request(req("r", toks, max_tokens=3, prompt_logprobs=1))
    outs = _run(eng)
    assert [len(o.token_ids) for o in outs] == [1, 1, 1]
    first = outs[0].prompt_logprobs
    assert first is not None and [lp.token_id for lp in first] == toks[1:]
    assert [lp.logprob for lp in first] == want
    # the top-1 alternative is the mock model's own next token, with probability 1
    assert [lp.top for lp in first] == [((runner.next_token(toks[:i]), 0.0),)
                                        for i in range(1, len(toks))]
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_a_prompt_logprobs_request_computes_its_whole_prompt_despite_the_cache() -> None:
    eng, runner, _ = make_engine(mock_cfg())
    toks, want = _prompt(runner)
    eng.add_request(req("warm", toks, max_tokens=1))
    _run(eng)
    eng.add_request(req("plain", toks, max_tokens=1))
    assert _run(eng)[0].num_cached_tokens > 0  # the cache holds the prompt
    eng.add_request(req("lp", toks, max_tokens=1, prompt_logprobs=0))
    batch = eng.scheduler.schedule()
    assert [(s.start_pos, len(s.token_ids)) for s in batch.seqs] == [(0, len(toks))]
    out = eng.scheduler.update(batch, runner.execute(batch))[0]
    eng.check_integrity()
    assert out.num_cached_tokens == 0 and out.finished
    assert out.prompt_logprobs is not None
    assert [lp.logprob for lp in out.prompt_logprobs] == want
    assert all(lp.top == () for lp in out.prompt_logprobs)  # k = 0: the prompt token's only


def test_max_tokens_zero_computes_the_prompt_and_draws_nothing() -> None:
    eng, runner, _ = make_engine(mock_cfg(max_num_batched_tokens=8))
    toks, want = _prompt(runner)
    eng.add_request(req("r", toks, max_tokens=0, prompt_logprobs=0, logprobs=0))
    (out,) = _run(eng)
    assert out.token_ids == [] and out.logprobs is None
    assert out.finished and out.finish_reason is FinishReason.LENGTH
    assert out.prompt_logprobs is not None and [lp.logprob for lp in out.prompt_logprobs] == want


def test_with_n_choices_only_the_first_output_of_choice_0_carries_them() -> None:
    eng, runner, _ = make_engine(mock_cfg())
    toks, want = _prompt(runner)
    eng.add_request(req("r", toks, max_tokens=2, prompt_logprobs=0, n=3, temperature=0))
    outs = _run(eng)
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].index == 0
    assert carrying[0] is next(o for o in outs if o.index == 0)
    assert [lp.logprob for lp in carrying[0].prompt_logprobs] == want
    assert sorted(len(o.token_ids) for o in outs) == [1] * 6
