"""The overlapped step loop (engine.overlap): the same greedy tokens as the serial loop,
the dropped extra token of a request that finished in the batch before, and no block
handed out (or imported into) while a forward in flight may still write it."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.api.outputs import FinishReason, TokenOutput
from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.engine.runner.base import ModelRunner
from services.engine.runner.mock_runner import MockRunner
from services.engine.runner.torch_runner import TorchRunner
from tests.support.engine_factory import EOS, mock_cfg, oracle, replay, req, run_all
from tests.support.tiny_model import tiny_hf_model

Result = dict[str, tuple[list[int], FinishReason | None]]


def with_overlap(cfg: EngineConfig, on: bool) -> EngineConfig:
    return cfg.model_copy(update={"overlap": on})


def workload(seed: int, vocab: int, n: int = 14) -> tuple[list[tuple[int, GenerateRequest]], dict[int, list[str]]]:
    """Requests arriving at random steps (shared prefixes: prefix hits; long prompts:
    chunked prefill; a small pool: preemption), stop ids, and aborts at random steps."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(13)]
    arrivals: list[tuple[int, GenerateRequest]] = []
    for i in range(n):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 24))]
        prompt = shared + tail if i % 3 else tail + shared
        stop = (rng.randrange(3, vocab),) if i % 4 == 1 else ()
        sp = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 16), stop_token_ids=stop)
        arrivals.append((rng.randrange(0, 12), GenerateRequest(f"r{i}", prompt, sp)))
    aborts: dict[int, list[str]] = {}
    for i in rng.sample(range(n), 3):
        aborts.setdefault(rng.randrange(1, 20), []).append(f"r{i}")
    return arrivals, aborts


def drive(eng: LLMEngine, arrivals: list[tuple[int, GenerateRequest]],
          aborts: dict[int, list[str]], each_step: Callable[[LLMEngine], None] | None = None,
          ) -> Result:
    """Step until drained; integrity (and ``each_step``) after every step."""
    got: dict[str, list[int]] = {r.request_id: [] for _, r in arrivals}
    reasons: dict[str, FinishReason | None] = {}
    last = max([s for s, _ in arrivals] + list(aborts))

    def take(out: TokenOutput | None) -> None:
        if out is None:
            return
        assert out.request_id not in reasons, f"{out.request_id}: output after its final one"
        got.setdefault(out.request_id, []).extend(out.token_ids)
        if out.finished:
            reasons[out.request_id] = out.finish_reason

    step = 0
    while eng.has_unfinished() or step <= last:
        for s, r in arrivals:
            if s == step:
                eng.add_request(r)
        for rid in aborts.get(step, []):
            take(eng.abort(rid))
        for out in eng.step():
            take(out)
        eng.check_integrity()
        if each_step is not None:
            each_step(eng)
        step += 1
        assert step < 3000, "engine did not drain"
    assert eng.stats().kv_blocks_used == 0
    eng.check_integrity()
    return {rid: (toks, reasons.get(rid)) for rid, toks in got.items()}


def assert_same(on: Result, off: Result, aborted: set[str]) -> None:
    for rid, (toks, reason) in off.items():
        if rid in aborted:
            # the abort lands a step later or earlier relative to the outputs; both runs
            # produce a prefix of the same greedy continuation
            a, b = toks, on[rid][0]
            n = min(len(a), len(b))
            assert a[:n] == b[:n], rid
        else:
            assert on[rid] == (toks, reason), rid


# ---- mock runner: the brute-force oracle ----------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_mock_overlap_equals_serial_and_the_oracle(seed: int) -> None:
    base = mock_cfg(num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=16,
                    eos_probability=0.05)
    arrivals, aborts = workload(seed, 1000)
    aborted = {rid for rids in aborts.values() for rid in rids}
    results: dict[bool, Result] = {}
    for on in (False, True):
        cfg = with_overlap(base, on)
        runner = MockRunner(cfg)
        events: list = []
        eng = LLMEngine(runner, cfg, [EOS], "w", events.append)
        assert eng.overlap is on

        def events_exact(e: LLMEngine, events: list = events) -> None:
            # the router's view rebuilt from the live events == the pool's own dump
            assert replay(events) == replay(e.dump_kv_events())

        results[on] = drive(eng, arrivals, aborts, events_exact)
        for _, r in arrivals:
            want, why = oracle(eng, runner, r)
            toks, reason = results[on][r.request_id]
            if r.request_id in aborted:
                assert toks == want[: len(toks)]
            else:
                assert (toks, reason) == (want, why), r.request_id
    assert_same(results[True], results[False], aborted)


def _mock_engine(**kw: object) -> tuple[LLMEngine, MockRunner]:
    cfg = with_overlap(mock_cfg(**kw), True)  # type: ignore[arg-type]
    runner = MockRunner(cfg)
    return LLMEngine(runner, cfg, [EOS]), runner


def test_finished_in_n_scheduled_in_n_plus_1_drops_the_extra_token_and_frees_blocks() -> None:
    eng, runner = _mock_engine()
    prompt = [7, 8, 9, 10, 11]
    want, _ = oracle(eng, runner, req("x", prompt, 10))
    stop = want[2]  # the third token stops it: the scheduler cannot know that in advance
    eng.add_request(req("x", prompt, 10, stop_token_ids=(stop,)))
    outs: list[TokenOutput] = []
    while True:
        new = eng.step()
        outs += new
        if any(o.finished for o in new):
            break
    assert [t for o in outs for t in o.token_ids] == want[:3]
    assert outs[-1].finish_reason is FinishReason.STOP
    # batch N+1, launched before N was read, holds x's decode of the stop token
    inflight = eng.in_flight_batch
    assert inflight is not None and [s.request_id for s in inflight.seqs] == ["x"]
    held = set(eng.kv.fence.held_blocks())
    assert held and held >= set(inflight.seqs[0].block_ids)  # freed, held for N+1
    assert eng.stats().kv_blocks_used == len(held)
    eng.check_integrity()
    assert eng.has_unfinished()  # a step must still read N+1 back
    assert eng.step() == []  # the extra token is dropped, never streamed
    assert not eng.has_unfinished() and eng.stats().kv_blocks_used == 0
    assert not list(eng.kv.fence.held_blocks())
    eng.check_integrity()


def test_length_capped_request_is_not_scheduled_again() -> None:
    eng, _ = _mock_engine()
    eng.add_request(req("x", [5, 6, 7], 2))
    assert eng.step() == []  # launches the prefill (samples token 1)
    first = eng.step()  # a batch without decodes is read back before the next is scheduled
    assert eng.in_flight_batch is None and [o.finished for o in first] == [False]
    assert eng.step() == []  # launches the decode of token 2 = max_tokens
    inflight = eng.in_flight_batch
    assert inflight is not None and inflight.seqs[0].start_pos == 3
    last = eng.step()  # capped: launches nothing for a third token; reads token 2
    assert eng.last_batch_size == 1 and eng.in_flight_batch is None
    assert [(o.finished, o.finish_reason) for o in last] == [(True, FinishReason.LENGTH)]
    assert not eng.has_unfinished() and eng.stats().kv_blocks_used == 0


class WriteWatch:
    """Fails when the pool hands out, or an import writes, a block a batch in flight may
    still write (the blocks along its sequences' tables up to their end positions)."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng = eng
        self.checked = 0
        pool_allocate = eng.pool.allocate
        runner_import = eng.runner.import_kv

        def allocate(n: int) -> list[int] | None:
            got = pool_allocate(n)
            if got:
                self.check(got, "allocated")
            return got

        def import_kv(block_ids: list[int], data: torch.Tensor) -> None:
            self.check(block_ids, "imported into")
            runner_import(block_ids, data)

        eng.pool.allocate = allocate  # type: ignore[method-assign]
        eng.runner.import_kv = import_kv  # type: ignore[method-assign]

    def check(self, blocks: list[int], what: str) -> None:
        batch = self.eng.in_flight_batch
        if batch is None or not self.eng.kv.fence.in_flight:
            return
        bs = self.eng.pool.block_size
        writing = {b for s in batch.seqs
                   for b in s.block_ids[s.start_pos // bs : -(-s.end_pos // bs)]}
        self.checked += 1
        bad = writing.intersection(blocks)
        assert not bad, f"blocks {sorted(bad)} {what} while the batch in flight writes them"


@pytest.mark.parametrize("seed", range(6))
def test_no_block_is_reused_while_a_forward_may_write_it(seed: int) -> None:
    """Tiny pool (preemption), aborts, and remote prefills parked, completed and failed
    at random steps, all with a batch in flight."""
    rng = random.Random(seed)
    eng, runner = _mock_engine(num_kv_blocks=20, max_num_seqs=6, max_num_batched_tokens=12)
    src, _ = _mock_engine(num_kv_blocks=64)  # computes the remote KV
    watch = WriteWatch(eng)
    arrivals, aborts = workload(seed, 1000, n=10)
    parked: list[str] = []
    remote = [GenerateRequest(f"m{i}", [rng.randrange(3, 1000) for _ in range(rng.randrange(5, 14))],
                              SamplingParams(temperature=0, max_tokens=rng.randrange(2, 8)))
              for i in range(4)]
    exported: dict[str, TokenOutput] = {}

    def remote_prefill(e: LLMEngine) -> None:
        step = e.num_steps
        if step % 5 == 2 and remote:
            r = remote.pop()
            h = e.begin_remote_prefill(r)
            if h is not None:
                parked.append(r.request_id)
                # run the prompt on the source engine, exporting the blocks asked for
                p = GenerateRequest(r.request_id, r.prompt_token_ids, SamplingParams(max_tokens=1),
                                    export_kv_from_block=h.first_block_to_fill)
                src.add_request(p)
                final = [o for o in _drain(src) if o.finished][0]
                exported[r.request_id] = final
        elif step % 5 == 4 and parked:
            rid = parked.pop(0)
            final = exported.pop(rid)
            if rng.random() < 0.3:
                assert e.fail_remote_prefill(rid)
            else:
                out = e.complete_remote_prefill(rid, final.kv, final.token_ids[0])
                assert out is not None and out.token_ids == final.token_ids
        e.check_integrity()

    result = drive(eng, arrivals, aborts, remote_prefill)
    while parked:  # requests parked at the end: fail them to local prefill and drain
        eng.fail_remote_prefill(parked.pop())
        while eng.has_unfinished():
            eng.step()
            eng.check_integrity()
    assert watch.checked > 0
    assert eng.stats().num_preemptions_total > 0 or seed % 2  # the pool is tight
    aborted = {rid for rids in aborts.values() for rid in rids}
    for _, r in arrivals:
        want, _ = oracle(eng, runner, r)
        toks = result[r.request_id][0]
        assert toks == (want[: len(toks)] if r.request_id in aborted else want)


def _drain(eng: LLMEngine) -> list[TokenOutput]:
    outs: list[TokenOutput] = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


def test_async_engine_with_overlap_streams_every_token_once() -> None:
    import asyncio

    from services.engine.async_engine import AsyncEngine

    eng, runner = _mock_engine(eos_probability=0.1)
    reqs = [req(f"a{i}", [i + 3, 4, 5, 6, 7], 12) for i in range(6)]

    async def main() -> list[list[TokenOutput]]:
        async with AsyncEngine(eng) as ae:
            async def one(r: GenerateRequest) -> list[TokenOutput]:
                return [o async for o in ae.generate(r)]
            res = await asyncio.gather(*(one(r) for r in reqs))
            await ae.check_integrity()
            return res

    for r, outs in zip(reqs, asyncio.run(main()), strict=True):
        want, why = oracle(eng, runner, r)
        assert [t for o in outs for t in o.token_ids] == want
        assert outs[-1].finish_reason is why and sum(o.finished for o in outs) == 1
    assert eng.stats().kv_blocks_used == 0


def test_mock_launch_returns_before_the_device_time() -> None:
    import time

    cfg = with_overlap(mock_cfg(), True).model_copy(
        update={"mock": mock_cfg().mock.model_copy(update={"step_base_s": 0.05})})
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        time.sleep(s)

    # NOTE: the runner's only wait on the simulated device is this sleep: recording it
    # shows the launch did not wait, however long a loaded machine takes to run it.
    runner = MockRunner(cfg, sleep=sleep)
    eng = LLMEngine(runner, cfg, [EOS])
    eng.add_request(req("x", [3, 4, 5], 3))
    eng.step()  # launches the prefill, reads nothing back
    assert runner.num_steps == 1 and slept == []
    _drain(eng)
    assert runner.busy_seconds == pytest.approx(0.05 * runner.num_steps)


# ---- torch runner: tiny model, SmolLM2, CUDA -------------------------------------------

def _torch_results(runner_for: Callable[[EngineConfig], TorchRunner], base: EngineConfig,
                   vocab: int, seed: int, n: int, eos: list[int]) -> tuple[dict[bool, Result], set[str]]:
    arrivals, aborts = workload(seed, vocab, n)
    aborted = {rid for rids in aborts.values() for rid in rids}
    results: dict[bool, Result] = {}
    for on in (False, True):
        cfg = with_overlap(base, on)
        eng = LLMEngine(runner_for(cfg), cfg, eos_token_ids=eos)
        assert eng.overlap is on
        results[on] = drive(eng, arrivals, aborts)
    return results, aborted


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_hf_model("llama", seed=7)


@pytest.mark.parametrize("seed", range(3))
def test_tiny_model_overlap_equals_serial(tiny_llama, seed: int) -> None:
    hf, arch = tiny_llama
    tensors = hf.state_dict()
    # a pool far smaller than the workload's demand: chunked prefill, hits, preemption
    base = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=24,
                        max_num_seqs=6, max_num_batched_tokens=12)
    results, aborted = _torch_results(lambda c: TorchRunner(arch, tensors, c), base, 128, seed, 12, [0])
    assert_same(results[True], results[False], aborted)


def test_smollm2_overlap_equals_serial(smollm2_path: Path) -> None:
    from services.engine.weights import load_weights

    loaded = load_weights(smollm2_path)
    base = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=40,
                        max_num_seqs=4, max_num_batched_tokens=24, max_model_len=256)
    results, aborted = _torch_results(
        lambda c: TorchRunner(loaded.arch, loaded.tensors, c, 256), base,
        loaded.arch.vocab_size, 0, 6, [2])
    assert_same(results[True], results[False], aborted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_overlap_equals_serial(tiny_llama, dtype: str) -> None:
    hf, arch = tiny_llama
    tensors = hf.state_dict()
    base = EngineConfig(device="cuda", dtype=dtype, block_size=4, num_kv_blocks=24,
                        max_num_seqs=6, max_num_batched_tokens=12)
    results, aborted = _torch_results(lambda c: TorchRunner(arch, tensors, c), base, 128, 1, 12, [0])
    assert_same(results[True], results[False], aborted)


def test_runner_without_launch_falls_back_to_the_serial_loop() -> None:
    class Serial(MockRunner):
        supports_overlap = False

    cfg = with_overlap(mock_cfg(), True)
    eng = LLMEngine(Serial(cfg), cfg, [EOS])
    assert not eng.overlap and isinstance(eng.runner, ModelRunner)


def test_auto_overlaps_where_it_pays(tiny_llama) -> None:
    """engine.overlap "auto" (the default): on for the mock runner's simulated device (and
    CUDA), off for the eager torch forward on CPU, where the measured on/off ratio is below
    1 (on beside the CPU kernels' one-call step: test_cpu_kernels.py)."""
    assert EngineConfig().overlap == "auto"
    mock = mock_cfg()
    assert LLMEngine(MockRunner(mock), mock, eos_token_ids=[0]).overlap
    hf, arch = tiny_llama
    cpu = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=8)
    assert not LLMEngine(TorchRunner(arch, hf.state_dict(), cpu), cpu, eos_token_ids=[0]).overlap
    forced = with_overlap(cpu, True)
    assert LLMEngine(TorchRunner(arch, hf.state_dict(), forced), forced, eos_token_ids=[0]).overlap


def test_a_prompt_that_arrives_during_a_step_of_prefill_alone_joins_the_next_step() -> None:
    """Batch N+1 is scheduled while N computes; when N holds no decode (a long prompt's slice,
    no stream running) it is read back first instead, so what arrived during it is in N+1."""
    eng, _ = _mock_engine(max_num_batched_tokens=8)
    eng.add_request(req("long", list(range(100, 124)), 2))  # three 8-token slices
    assert eng.step() == []  # launches the first slice
    eng.add_request(req("short", [5, 6, 7], 6))  # arrives while it computes
    assert eng.step() == [] and eng.in_flight_batch is None  # read back; nothing launched
    eng.step()
    inflight = eng.in_flight_batch
    assert inflight is not None and "short" in {s.request_id for s in inflight.seqs}
    # once a stream decodes, steps overlap again: N+1 is in flight while N is read back
    for _ in range(10):
        eng.step()
        if eng.in_flight_batch is not None and eng.in_flight_batch.num_decodes:
            break
    decoding = eng.in_flight_batch
    assert decoding is not None and decoding.num_decodes
    eng.step()
    assert eng.in_flight_batch is not None and eng.in_flight_batch is not decoding
    run_all(eng)
    assert not eng.has_unfinished() and eng.stats().kv_blocks_used == 0
