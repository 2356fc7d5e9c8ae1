"""The real SmolLM2-135M-Instruct through our own engine: it knows Paris and stops at its
end-of-turn token."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.api.outputs import FinishReason
from services.api.sampling import SamplingParams
from services.common.config import parse_config
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest

ROOT = Path(__file__).resolve().parents[3]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# NOTE: float32 on purpose. The answer's first token is a near-tie ("The" 25.33 against "L"
# 25.24 in float32) that bfloat16 rounding flips on CUDA ("L'Étoile, ..."); these tests check
# the model's knowledge and end-of-turn handling. How far bfloat16 and int4 stray from float32
# is test_quant_smollm2's job.


@pytest.fixture(scope="module")
def parts(smollm2_path: Path):
    cfg = parse_config({"engine": {"threads": 1, "num_kv_blocks": 256, "dtype": "float32"}})
    return build_engine(cfg)


def test_smollm2_answers_paris_and_stops_at_end_of_turn(parts) -> None:
    tok = parts.tokenizer
    engine = parts.engine
    prompt = tok.encode_chat(QUESTION)
    sampling = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=tok.stop_token_ids)
    engine.add_request(GenerateRequest("paris", prompt, sampling))
    ids: list[int] = []
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            ids.extend(out.token_ids)
            last = out
    assert last is not None and last.finished
    assert last.finish_reason is FinishReason.STOP
    end_of_turn = tok.token_to_id("<|im_end|>")
    assert ids[-1] == end_of_turn, "should stop on <|im_end|>"
    text = tok.decode(ids)
    assert "Paris" in text, text
    assert engine.stats().kv_blocks_used == 0
    engine.check_integrity()


def test_tandem_chat_cli_one_shot(smollm2_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "chat", "--prompt", "What is the capital of France?",
         "--max-tokens", "48", "--set", "engine.dtype=float32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_the_readmes_example_answers_paris_on_the_default_path(smollm2_path: Path) -> None:
    """The quick start's curl body, as the README prints it, on the default dtype and
    quantization (the 4-bit kernels wherever the CPU has them): the answer a new user sees.
    Its greedy tokens lead their runner-up by >= 1.38 in logprob up to "Paris" (4.75 at it)
    on the AVX2 kernels, dense float32 and torch's int4 alike (2026-11-29), where the bare
    question's first token was a 0.09 near-tie."""
    readme = (ROOT / "README.md").read_text()
    body = json.loads(re.search(r"-d '(\{.*?\})'", readme).group(1))
    parts = build_engine(parse_config({"engine": {"threads": 1, "num_kv_blocks": 256}}))
    tok = parts.tokenizer
    sampling = SamplingParams(temperature=body["temperature"], max_tokens=body["max_tokens"],
                              stop_token_ids=tok.stop_token_ids)
    parts.engine.add_request(GenerateRequest("readme", tok.encode_chat(body["messages"]), sampling))
    ids: list[int] = []
    while parts.engine.has_unfinished():
        for out in parts.engine.step():
            ids.extend(out.token_ids)
    text = tok.decode(ids)
    assert "Paris" in text, text
