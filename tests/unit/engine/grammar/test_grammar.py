"""Constrained decoding with the real SmolLM2 (CPU): outputs match their grammar, overlap
on and off agree, a grammar row and a free row share a batch, a refused token ends only
its request, a migrated request replays its grammar, forced tool calls on pydantic schemas
(no additionalProperties) call their functions and free ones cannot nest forever, and the
mask math itself."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch

from services.api.json_schema import MAX_FREE_DEPTH
from services.api.outputs import FinishReason
from services.api.processor import Tool, ToolChoice
from services.api.sampling import SamplingParams
from services.api.structured import StructuredKind, StructuredOutput
from services.common.config import EngineConfig
from services.common.errors import GenerationFailed
from services.engine.async_engine import AsyncEngine
from services.engine.engine import LLMEngine
from services.engine.grammar.batch_mask import BatchMask, unpack_allowed
from services.engine.grammar.compiler import GrammarCompiler
from services.engine.grammar.state import GrammarState
from services.engine.grammar.stats import GrammarStats
from services.engine.request import GenerateRequest
from services.engine.runner.torch_runner import TorchRunner
from services.engine.scheduler import InvalidRequestError
from services.model.tokenizer import Tokenizer
from services.processor.tools import (
    ToolCallParser,
    call_schema,
    strict_calls_grammar,
    system_prompt,
)
from tests.support.tool_models import Search, Weather, get_weather, search

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ("yes", "no", "maybe so")


@pytest.fixture(scope="module")
def model(smollm2_path: Path):
    from services.engine.weights import load_weights

    return load_weights(smollm2_path), Tokenizer.from_path(smollm2_path)


def make_engine(model, overlap: bool, max_num_seqs: int = 4, num_kv_blocks: int = 64,
                device: str = "cpu", dtype: str = "float32") -> LLMEngine:
    loaded, tok = model
    cfg = EngineConfig(device=device, dtype=dtype, block_size=16, num_kv_blocks=num_kv_blocks,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                       max_model_len=512, overlap=overlap)
    runner = TorchRunner(loaded.arch, loaded.tensors, cfg, 512)
    grammar = GrammarCompiler(tok.to_json(), runner.vocab_size, tok.stop_token_ids)
    eng = LLMEngine(runner, cfg, tok.stop_token_ids, grammar=grammar)
    assert eng.overlap is overlap
    return eng


def prompt(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": text}])


def run(eng: LLMEngine, reqs: list[GenerateRequest]) -> dict[str, tuple[list[int], FinishReason, str | None]]:
    for r in reqs:
        eng.validate(r)
        eng.add_request(r)
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    done: dict[str, tuple[list[int], FinishReason, str | None]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id].extend(o.token_ids)
            if o.finished:
                assert o.finish_reason is not None
                done[o.request_id] = (toks[o.request_id], o.finish_reason, o.error)
    eng.check_integrity()
    assert eng.pool.num_used == 0
    return done


def mixed_requests(tok: Tokenizer) -> list[GenerateRequest]:
    def sp(structured: StructuredOutput | None, n: int = 48) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, structured=structured)

    return [
        GenerateRequest("json", prompt(tok, "Describe a person as JSON."), sp(StructuredOutput.json_schema(SCHEMA))),
        GenerateRequest("free", prompt(tok, "Describe a person as JSON."), sp(None, 24)),
        GenerateRequest("regex", prompt(tok, "Give me a code."), sp(StructuredOutput(StructuredKind.REGEX, REGEX))),
        GenerateRequest("choice", prompt(tok, "Is the sky blue?"),
                        sp(StructuredOutput(StructuredKind.CHOICE, choices=CHOICES))),
    ]


def test_outputs_match_their_grammar_and_overlap_agrees_with_serial(model) -> None:
    tok = model[1]
    results = {on: run(make_engine(model, on), mixed_requests(tok)) for on in (False, True)}
    assert results[True] == results[False]
    r = results[True]
    text = {k: tok.decode(v[0]) for k, v in r.items()}
    assert r["json"][1] is FinishReason.STOP, text["json"]
    jsonschema.validate(json.loads(text["json"]), SCHEMA)
    assert re.fullmatch(REGEX, text["regex"]) and r["regex"][1] is FinishReason.STOP
    assert text["choice"] in CHOICES
    # The free row in a batch with grammar rows is untouched: the same as alone.
    alone = run(make_engine(model, True), [mixed_requests(tok)[1]])
    assert alone["free"] == r["free"]
    assert not text["free"].startswith("{") or text["free"] != text["json"]


LIST_SCHEMA = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
    "type": "object", "required": ["id", "name"], "additionalProperties": False,
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "name": {"type": "string", "maxLength": 8}}}}


def test_preempted_constrained_requests_resume_their_grammar(model) -> None:
    """A pool too small for the batch: sequences are preempted and recomputed mid-answer
    (a token may be in flight as it happens); their matchers carry on, overlap or not."""
    tok = model[1]
    spec = StructuredOutput.json_schema(LIST_SCHEMA)
    reqs = [GenerateRequest(f"r{i}", prompt(tok, f"List four {w} as JSON."),
                            SamplingParams(temperature=0, max_tokens=64, structured=spec))
            for i, w in enumerate(("cities", "animals", "colours", "friends"))]
    results = {}
    for on in (False, True):
        eng = make_engine(model, on, num_kv_blocks=14)
        results[on] = run(eng, reqs)
        assert eng.scheduler.num_preemptions > 0
    assert results[True] == results[False]
    stopped = 0
    for toks, reason, error in results[True].values():
        assert error is None
        if reason is FinishReason.STOP:
            jsonschema.validate(json.loads(tok.decode(toks)), LIST_SCHEMA)
            stopped += 1
    assert stopped >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_constrained_outputs_match_and_overlap_agrees(model, dtype: str) -> None:
    """On CUDA the mask crosses from pinned host memory on the forward stream, and with
    overlap the sampler waits for it on the forward thread."""
    tok = model[1]
    results = {on: run(make_engine(model, on, device="cuda", dtype=dtype), mixed_requests(tok))
               for on in (False, True)}
    assert results[True] == results[False]
    r = results[True]
    jsonschema.validate(json.loads(tok.decode(r["json"][0])), SCHEMA)
    assert re.fullmatch(REGEX, tok.decode(r["regex"][0]))
    assert tok.decode(r["choice"][0]) in CHOICES


def test_refused_token_ends_only_that_request(model, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = model[1]
    eng = make_engine(model, True)
    real = GrammarState.advance
    calls = {"n": 0}

    def flaky(self: GrammarState, token: int) -> str | None:
        if self.kind == "regex":
            calls["n"] += 1
            if calls["n"] == 2:
                self.error = f"the regex grammar refused token {token}"
                return self.error
        return real(self, token)

    monkeypatch.setattr(GrammarState, "advance", flaky)
    r = run(eng, mixed_requests(tok))
    toks, reason, error = r["regex"]
    assert reason is FinishReason.ERROR and len(toks) == 1
    assert error is not None and "'regex'" in error and "refused token" in error
    for rid in ("json", "free", "choice"):
        assert r[rid][1] in (FinishReason.STOP, FinishReason.LENGTH) and r[rid][2] is None
    assert eng.scheduler.num_grammar_seqs == 0


def test_async_engine_raises_generation_failed_for_that_request(model, monkeypatch) -> None:
    tok = model[1]
    monkeypatch.setattr(GrammarState, "advance", lambda self, t: "refused")
    req = mixed_requests(tok)[3]

    async def go() -> None:
        async with AsyncEngine(make_engine(model, False)) as ae:
            with pytest.raises(GenerationFailed, match="refused"):
                async for _ in ae.generate(req):
                    pass
            assert ae.stats().kv_blocks_used == 0

    asyncio.run(go())


def test_migrated_request_replays_its_grammar(model) -> None:
    tok = model[1]
    req = mixed_requests(tok)[0]
    whole = run(make_engine(model, False), [req])["json"][0]
    k = 5
    sp = SamplingParams(temperature=0, max_tokens=48 - k, seed_step_offset=k,
                        structured=req.sampling.structured)
    moved = GenerateRequest("json", req.prompt_token_ids + whole[:k], sp)
    rest = run(make_engine(model, True), [moved])["json"][0]
    assert whole[:k] + rest == whole
    # A replay the grammar refuses is a bad request, refused at add.
    bad = GenerateRequest("bad", req.prompt_token_ids + tok.encode("nope"),
                          SamplingParams(seed_step_offset=2, structured=req.sampling.structured))
    eng = make_engine(model, False)
    with pytest.raises(InvalidRequestError, match="replaying"):
        eng.add_request(bad)
    assert eng.scheduler.num_grammar_seqs == 0 and not eng.scheduler.seqs


def test_uncompilable_spec_is_refused_at_validate(model) -> None:
    tok = model[1]
    eng = make_engine(model, False)
    bad = GenerateRequest("x", prompt(tok, "hi"),
                          SamplingParams(structured=StructuredOutput(StructuredKind.REGEX, "(ab")))
    with pytest.raises(InvalidRequestError, match="does not compile"):
        eng.validate(bad)


def test_mask_apply_sets_only_disallowed_logits_of_grammar_rows() -> None:
    vocab, words = 70, 3
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g)
    bits = torch.randint(-(2**31), 2**31 - 1, (1, words), dtype=torch.int32, generator=g)
    mask = BatchMask([1], [], bits, 3, GrammarStats())
    mask.ready.set()
    out = mask.apply(logits.clone())
    allowed = [bool((int(bits[0, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    for t in range(vocab):
        assert out[1, t].item() == (logits[1, t].item() if allowed[t] else float("-inf"))
    assert unpack_allowed(bits, vocab)[0].tolist() == allowed


class _ZeroExecutor:
    def unsafe_compute_mask_ptr(self, live, ptr, nbytes, n) -> None:
        pass  # leaves the zeros the test put there: "nothing allowed"


def test_mask_that_allows_nothing_kills_that_row_and_sets_ready(model) -> None:
    tok = model[1]
    comp = GrammarCompiler(tok.to_json(), 49152, tok.stop_token_ids)
    states = [comp.start(StructuredOutput(StructuredKind.JSON_OBJECT)) for _ in range(2)]
    bits = torch.zeros(2, (49152 + 31) // 32, dtype=torch.int32)
    mask = BatchMask([0, 1], states, bits, 2, GrammarStats())
    mask.fill(_ZeroExecutor())  # type: ignore[arg-type]
    assert mask.ready.is_set()
    assert all(s.dead and "allows no token" in (s.error or "") for s in states)
    assert bool((bits == -1).all())
    assert states[0].advance(123) is not None


def test_compiled_grammars_are_cached_by_spec(model) -> None:
    tok = model[1]
    comp = GrammarCompiler(tok.to_json(), 49152, tok.stop_token_ids)
    a = StructuredOutput.json_schema({"type": "object", "required": ["x"], "properties": {"x": {"type": "number"}}})
    b = StructuredOutput.json_schema({"properties": {"x": {"type": "number"}}, "required": ["x"], "type": "object"})
    assert a.key == b.key
    comp.start(a)
    comp.start(b)
    assert sum(comp.stats.compile_seconds.counts) == 1
    assert comp.stats.requests_by_kind["json_schema"] == 2


def test_each_lane_is_its_own_compile_and_fills_the_same_masks(model, monkeypatch) -> None:
    """threads=3: a spec compiles to three lanes taken in turn, and masks filled in
    parallel across lanes equal those of one lane, step by step; a spec whose compile is
    slow gets one lane."""
    from services.engine.grammar import compiler as compiler_mod

    tok = model[1]
    spec = StructuredOutput.json_schema(LIST_SCHEMA)
    lanes = GrammarCompiler(tok.to_json(), 49152, tok.stop_token_ids, threads=3)
    one = GrammarCompiler(tok.to_json(), 49152, tok.stop_token_ids, threads=1)
    a = [lanes.start(spec) for _ in range(6)]
    b = [one.start(spec) for _ in range(6)]
    assert len(lanes._lanes(spec)) == 3 and len(one._lanes(spec)) == 1
    assert sum(lanes.stats.compile_seconds.counts) == 1  # one cache miss, however many lanes
    words = (49152 + 31) // 32
    text = '[{"id":7,"name":"ab"},{"id":12,"name":"xyz"},{"id":3,"name":""},{"id":0,"name":"q"}]'
    for t in tok.encode(text):
        masks = []
        for comp, states in ((lanes, a), (one, b)):
            bits = torch.zeros(len(states), words, dtype=torch.int32)
            BatchMask(list(range(len(states))), states, bits, len(states), comp.stats).fill(comp.executor)
            masks.append(bits)
        assert torch.equal(masks[0], masks[1])
        assert all(bool((masks[0][i, t // 32] >> (t % 32)) & 1) for i in range(6))
        for s in (*a, *b):
            assert s.advance(t) is None
    monkeypatch.setattr(compiler_mod, "LANE_COMPILE_LIMIT_S", 0.0)
    slow = GrammarCompiler(tok.to_json(), 49152, tok.stop_token_ids, threads=3)
    slow.start(spec)
    assert len(slow._lanes(spec)) == 1


def test_overlapped_fill_starts_after_the_matchers_took_their_tokens(model, monkeypatch) -> None:
    """The overlapped loop fills N+1's mask on the filler thread, started once update(N)
    has advanced every grammar row (the rest of update does not advance them again)."""
    from services.engine.grammar.batch_mask import MaskFiller

    tok = model[1]
    eng = make_engine(model, True)
    at_start: list[list[tuple[GrammarState, int]]] = []
    threads: set[str] = set()
    real_start, real_fill = MaskFiller.start, BatchMask.fill

    def start(self: MaskFiller, mask: BatchMask) -> None:
        at_start.append([(s, s.last_pos) for s in mask.states])
        real_start(self, mask)

    def fill(self: BatchMask, executor) -> None:
        threads.add(threading.current_thread().name)
        real_fill(self, executor)

    monkeypatch.setattr(MaskFiller, "start", start)
    monkeypatch.setattr(BatchMask, "fill", fill)
    reqs = mixed_requests(tok)
    for r in reqs:
        eng.add_request(r)
    checked = 0
    while eng.has_unfinished():
        before = len(at_start)
        eng.step()
        for snapshot in at_start[before:]:
            for state, pos in snapshot:
                assert state.last_pos == pos  # update(N) found every token already taken
                checked += pos >= 0
    assert checked > 20
    assert any(name.startswith("engine-grammar") for name in threads)
    assert eng.pool.num_used == 0


def test_a_step_failing_before_the_fill_started_still_fills_the_launched_mask(model, monkeypatch) -> None:
    """update(N) raising before the matchers are advanced: the step raises, and the mask of
    the batch already launched is filled anyway, so its forward thread is not left waiting
    and the batch completes."""
    from services.engine.scheduler import Scheduler

    tok = model[1]
    eng = make_engine(model, True)
    calls = {"n": 0}
    real = Scheduler._advance_grammars

    def failing(self, batch, sampled) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        real(self, batch, sampled)

    monkeypatch.setattr(Scheduler, "_advance_grammars", failing)
    for r in mixed_requests(tok):
        eng.add_request(r)
    with pytest.raises(RuntimeError, match="boom"):
        while eng.has_unfinished():
            eng.step()
    assert eng._in_flight is not None
    launched, pending, _ = eng._in_flight
    assert launched.grammar_mask is not None and launched.grammar_mask.ready.is_set()
    assert pending._future.result(timeout=60) is not None  # the forward thread finished


def test_worker_metrics_show_compiles_mask_fills_and_kinds(model) -> None:
    from prometheus_client import CollectorRegistry

    from services.engine.stats_metrics import EngineStatsCollector

    tok = model[1]
    eng = make_engine(model, False)
    run(eng, mixed_requests(tok)[2:])  # a regex and a choice request
    reg = CollectorRegistry()
    reg.register(EngineStatsCollector(eng.stats))
    assert reg.get_sample_value("tandem_worker_grammar_compile_seconds_count") == 2
    assert reg.get_sample_value("tandem_worker_grammar_mask_fill_seconds_count") >= 2
    assert reg.get_sample_value("tandem_worker_structured_requests_total", {"kind": "regex"}) == 1
    assert reg.get_sample_value("tandem_worker_structured_requests_total", {"kind": "choice"}) == 1
    assert reg.get_sample_value("tandem_worker_grammar_errors_total") == 0


def test_bench_structured_decode_keeps_every_sequence_under_the_schema(model) -> None:
    from services.bench.engine import bench_decode, bench_schema

    eng = make_engine(model, True)
    gen = torch.Generator().manual_seed(0)
    out = bench_decode(eng, 3, 6, 8, 1, gen, bench_schema(6))
    assert out["tok_s"] > 0 and out["mask_fill_ms_per_step"] > 0
    assert eng.grammar is not None and eng.grammar.stats.errors == 0
    assert eng.grammar.stats.requests_by_kind["json_schema"] == 3
    assert eng.pool.num_used == 0


def forced_calls(tok: Tokenizer, tools: list[Tool], asks: list[tuple[str, ToolChoice]],
                 max_tokens: int) -> list[GenerateRequest]:
    return [GenerateRequest(f"call{i}", tok.encode_chat([
        {"role": "system", "content": system_prompt(tools)}, {"role": "user", "content": q}]),
        SamplingParams(temperature=0, max_tokens=max_tokens,
                       structured=StructuredOutput.json_schema(call_schema(tools, choice))))
        for i, (q, choice) in enumerate(asks)]


def test_forced_calls_on_pydantic_schemas_call_their_functions(model) -> None:
    # NOTE: pydantic's schemas do not say additionalProperties; read as JSON Schema's open
    # default, SmolLM2 wrote {"city": "Paris", "type": {"string": {...}}} and nested on.
    _, tok = model
    fns = {"get_weather": get_weather, "search": search}
    tools = [Tool("get_weather", "Get the current weather in a city",
                  json.dumps(Weather.model_json_schema())),
             Tool("search", "Search the web", json.dumps(Search.model_json_schema()))]
    asks = [(q, c) for q in ("What is the weather like in Paris?", "Is it cold in Oslo?",
                             "Search news about Mars", "Find me recipes for pancakes")
            for c in (ToolChoice("required"), ToolChoice("function", "get_weather"),
                      ToolChoice("function", "search"))]
    done = run(make_engine(model, overlap=False), forced_calls(tok, tools, asks, 96))
    for i, (q, choice) in enumerate(asks):
        toks, reason, _ = done[f"call{i}"]
        assert reason is FinishReason.STOP, (q, tok.decode(toks))
        parser = ToolCallParser(tools, choice)
        parser.feed(tok.decode(toks))
        rest, (call,) = parser.finish()
        assert rest == "" and choice.name in ("", call.name)
        fns[call.name](**json.loads(call.arguments))


# Calls shown to the model with keys its functions do not take: SmolLM2 copies them (and
# names functions that do not exist, and nests arguments until max_tokens) unless the
# grammar holds its calls to the schemas.
SHOTS = [{"role": "user", "content": "What is the weather like in Rome?"},
         {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                          '{"city": "Rome", "country": "Italy"}}\n</tool_call>'},
         {"role": "user", "content": "Search the web for the news about Jupiter"},
         {"role": "assistant", "content": '<tool_call>\n{"name": "search", "arguments": '
                                          '{"query": "Jupiter news", "lang": "en"}}\n</tool_call>'}]


def test_strict_tools_under_auto_give_free_text_or_calls_that_validate(model) -> None:
    """tool_choice "auto" with strict tools (pydantic schemas, which do not close their
    objects): every call the model makes names a function, runs it and validates; where it
    answers in words, the words are what it writes without the grammar."""
    _, tok = model
    fns = {"get_weather": get_weather, "search": search}
    classes = {"get_weather": Weather, "search": Search}
    tools = [Tool("get_weather", "Get the current weather in a city",
                  json.dumps(Weather.model_json_schema())),
             Tool("search", "Search the web", json.dumps(Search.model_json_schema()))]
    grammar = StructuredOutput(StructuredKind.GRAMMAR, strict_calls_grammar(tools))
    asks = [(q, SHOTS) for q in ("What is the weather like in Paris?", "Is it cold in Oslo?",
                                 "Search news about Mars", "Say hello to me.")]
    asks += [(q, []) for q in ("What is the weather like in Paris?", "Search news about Mars")]

    def answers(structured: StructuredOutput | None) -> list[tuple[str, FinishReason]]:
        reqs = [GenerateRequest(f"a{i}", tok.encode_chat([
            {"role": "system", "content": system_prompt(tools)}, *shots,
            {"role": "user", "content": q}]),
            SamplingParams(temperature=0, max_tokens=64, structured=structured))
            for i, (q, shots) in enumerate(asks)]
        done = run(make_engine(model, overlap=False), reqs)
        return [(tok.decode(done[f"a{i}"][0]), done[f"a{i}"][1]) for i in range(len(asks))]

    free = answers(None)
    for (q, shots), (text, reason), (free_text, _) in zip(asks, answers(grammar), free, strict=True):
        parser = ToolCallParser(tools, ToolChoice("auto"))
        streamed = parser.feed(text)
        rest, calls = parser.finish(cut=reason is FinishReason.LENGTH)
        if not shots:  # the model answers in words: the grammar changes none of them
            assert calls == () and text == free_text, (q, text)
            continue
        assert reason is FinishReason.STOP and rest == streamed == "" and len(calls) == 1, (q, text)
        args = json.loads(calls[0].arguments)
        assert set(args) <= set(classes[calls[0].name].model_fields), (q, text)
        classes[calls[0].name].model_validate(args)
        fns[calls[0].name](**args)


def _depth(text: str) -> int:
    """How deep ``text``'s arrays and objects nest (outside strings)."""
    depth = most = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            most = max(most, depth)
        elif ch in "]}":
            depth -= 1
    return most


def test_forced_call_with_free_parameters_cannot_nest_forever(model) -> None:
    _, tok = model
    tools = [Tool("get_weather", "Get the current weather in a city", json.dumps({"type": "object"}))]
    asks = [("What is the weather like in Paris?", ToolChoice("required")),
            ("Is it cold in Oslo? Give every detail.", ToolChoice("required"))]
    done = run(make_engine(model, overlap=False), forced_calls(tok, tools, asks, 160))
    for toks, _, _ in done.values():
        # the call's object, its arguments, then the free values' bound
        assert _depth(tok.decode(toks)) <= 2 + MAX_FREE_DEPTH - 1, tok.decode(toks)


def test_an_engine_is_freed_with_its_last_reference(model) -> None:
    """No reference cycle holds an engine that ran grammar rows on the overlapped loop:
    its weights and KV pool go with its last reference, not at some later full gc (a
    stored bound method did hold them: test processes grew by an engine a test)."""
    import gc
    import weakref

    eng = make_engine(model, overlap=True)
    run(eng, mixed_requests(model[1]))
    ref = weakref.ref(eng)
    gc.disable()
    try:
        del eng
        assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
    finally:
        gc.enable()
