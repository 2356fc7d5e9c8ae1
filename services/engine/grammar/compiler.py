"""Per-worker grammar compiler: the llguidance tokenizer of the served model and a cache of
compiled matchers keyed by the spec's hash. A request gets a copy of the cached matcher
(microseconds), so only the first request with a given schema pays for its compile.

Copies of one compiled matcher share its lexer behind one lock, so their masks fill one at
a time whatever the executor's threads. A spec is therefore compiled once per fill thread
(a *lane*; up to ``threads``, where its first compile was quick) and requests take the
lanes in turn: the rows of a batch then fill in parallel.

Thread-safe: ``check`` runs where requests enter (a gRPC handler thread), ``start`` on the
engine's step thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import llguidance as llg

from services.api.structured import StructuredOutput, to_grammar
from services.engine.grammar.state import GrammarState
from services.engine.grammar.stats import GrammarStats

# A spec whose first compile took longer than this gets no more lanes: compiling it again
# for each fill thread would cost more than the parallel fill saves.
LANE_COMPILE_LIMIT_S = 0.02


def default_threads() -> int:
    """``engine.grammar_threads: 0``: half the CPUs, 1 to 8 (the fill scales no further)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


class GrammarCompileError(ValueError):
    """The spec does not compile; the message names the problem."""


class GrammarCompiler:
    """``tokenizer_json``: the HF ``tokenizers`` JSON of the model (``Tokenizer.to_json``);
    ``vocab_size``: the model's logits width (may exceed the tokenizer's); ``eos_token_ids``:
    what ends a request, the only tokens a finished grammar allows."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 256, threads: int = 1) -> None:
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                         eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.stats = GrammarStats()
        self._cache: OrderedDict[str, list[llg.LLMatcher]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.threads = max(1, threads)
        self._turn = 0  # the lane the next request copies
        # Fills many matchers' masks in parallel, off the GIL.
        self.executor = llg.LLExecutor(self.threads)

    def _lanes(self, spec: StructuredOutput) -> list[llg.LLMatcher]:
        key = spec.key
        with self._lock:
            lanes = self._cache.get(key)
            if lanes is not None:
                self._cache.move_to_end(key)
                return lanes
        t0 = time.perf_counter()
        try:
            grammar = to_grammar(spec)
        except (ValueError, TypeError) as e:
            raise GrammarCompileError(f"structured_outputs: the {spec.kind.value} does not "
                                      f"compile: {e}") from None
        lanes = [self._compile(spec, grammar)]
        if time.perf_counter() - t0 <= LANE_COMPILE_LIMIT_S:
            lanes += [self._compile(spec, grammar) for _ in range(self.threads - 1)]
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.compile_seconds.observe(dt)
            self._cache[key] = lanes
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return lanes

    def _compile(self, spec: StructuredOutput, grammar: str) -> llg.LLMatcher:
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarCompileError(f"structured_outputs: the {spec.kind.value} does not "
                                      f"compile: {m.get_error().strip()}")
        return m

    def check(self, spec: StructuredOutput) -> None:
        """Compile (or find) ``spec``; GrammarCompileError names what does not compile."""
        self._lanes(spec)

    def start(self, spec: StructuredOutput, replay: Sequence[int] = ()) -> GrammarState:
        """A fresh matcher for one request, advanced over ``replay`` (tokens the request
        generated elsewhere before it migrated here); GrammarCompileError if ``spec`` does
        not compile or a replayed token is refused."""
        lanes = self._lanes(spec)
        m = lanes[self._turn % len(lanes)].deep_copy()
        self._turn += 1
        state = GrammarState(m, spec.kind.value)
        for tok in replay:
            err = state.advance(tok)
            if err is not None:
                raise GrammarCompileError(f"structured_outputs: replaying the tokens generated "
                                          f"before migration: {err}")
        with self._lock:
            self.stats.requests_by_kind[spec.kind.value] += 1
        return state
