"""Factories for engine tests: tiny mock-runner engines, the brute-force token oracle and a
toy router index over KV events."""

from __future__ import annotations

from services.api.kv_events import KvCleared, KvEvent, KvStored
from services.api.outputs import FinishReason
from services.api.sampling import SamplingParams
from services.common.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.request import GenerateRequest
from services.engine.runner.mock_runner import MockRunner
from tests.support.mock_cluster import MOCK_ENGINE, merged

EOS = 2


def mock_cfg(
    *,
    block_size: int = 4,
    num_kv_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int | None = 256,
    vocab_size: int = 1000,
    eos_probability: float = 0.0,
    long_prefill_token_threshold: int = 512,
) -> EngineConfig:
    """The mock-cluster engine (``MOCK_ENGINE``) sized for exact block-id tests: free steps."""
    return EngineConfig(**merged(MOCK_ENGINE, {
        "block_size": block_size, "num_kv_blocks": num_kv_blocks, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len,
        "long_prefill_token_threshold": long_prefill_token_threshold,
        "mock": {"step_base_s": 0, "vocab_size": vocab_size, "eos_token_id": EOS,
                 "eos_probability": eos_probability}}))


def make_engine(
    cfg: EngineConfig | None = None, worker_id: str = "w"
) -> tuple[LLMEngine, MockRunner, list[KvEvent]]:
    cfg = cfg or mock_cfg()
    runner = MockRunner(cfg)
    events: list[KvEvent] = []
    return LLMEngine(runner, cfg, [EOS], worker_id, events.append), runner, events


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kw: object) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw))


def oracle(engine: LLMEngine, runner: MockRunner, request: GenerateRequest) -> tuple[list[int], FinishReason]:
    """What the request must produce: each next token = f(the full token list so far)."""
    sp = request.sampling
    toks = list(request.prompt_token_ids)
    out: list[int] = []
    max_len = engine.scheduler.max_model_len
    while True:
        t = runner.next_token(toks)
        toks.append(t)
        out.append(t)
        if (not sp.ignore_eos and t == EOS) or t in sp.stop_token_ids:
            return out, FinishReason.STOP
        if len(out) >= sp.max_tokens or len(toks) >= max_len:
            return out, FinishReason.LENGTH


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until idle, checking integrity after every step; tokens per request."""
    got: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
        engine.check_integrity()
    else:
        raise AssertionError("engine did not finish")
    return got


def replay(events: list[KvEvent]) -> dict[int, int | None]:
    """A toy router index: seq_hash -> parent seq_hash."""
    index: dict[int, int | None] = {}
    for e in events:
        if isinstance(e, KvCleared):
            index.clear()
        elif isinstance(e, KvStored):
            parent = e.parent_seq_hash
            for b in e.blocks:
                index[b.seq_hash] = parent
                parent = b.seq_hash
        else:
            for h in e.seq_hashes:
                index.pop(h, None)
    return index
