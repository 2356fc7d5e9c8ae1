"""`tandem up --set engine.tensor_parallel_size=3` (decode and prefill workers each split
three ways over SmolLM2's 3 KV heads): the README's question, and a long prompt prefilled
by the TP=3 prefill worker, get the same greedy answers as one unsplit in-process engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from services.api.sampling import SamplingParams
from services.common.config import load_config
from services.engine.factory import build_engine
from services.engine.request import GenerateRequest
from tests.support.mock_cluster import MODEL
from tests.support.up import FRANCE, LONG, REPO, local_ports, start_up

TP_SETTINGS = ["engine.tensor_parallel_size=3", "engine.dtype=float32"]


@pytest.fixture(scope="module")
def tp_cluster(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    ports, overrides = local_ports()
    overrides = TP_SETTINGS + overrides
    up = start_up(REPO / "configs" / "local.yaml", tmp_path_factory.mktemp("tp") / "run",
                  ["--ready-timeout", "400", "--fail-fast"], overrides)
    try:
        up.wait_for(r"^tandem is ready in", timeout=420)
        yield f"http://127.0.0.1:{ports['front']}/v1", f"http://127.0.0.1:{ports['decode_m']}/metrics"
    finally:
        assert up.stop(timeout=120) == 0, up.output()


def _local_greedy(messages: list[dict[str, str]], max_tokens: int) -> str:
    """The unsplit answer: one in-process engine at TP=1, same dtype."""
    parts = build_engine(load_config(REPO / "configs" / "local.yaml",
                                     ["engine.num_kv_blocks=128", "engine.dtype=float32"]))
    tok, engine = parts.tokenizer, parts.engine
    engine.add_request(GenerateRequest("local", tok.encode_chat(messages), SamplingParams(
        temperature=0, max_tokens=max_tokens, stop_token_ids=tok.stop_token_ids)))
    ids: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            ids.extend(out.token_ids)
    return tok.decode(ids)


def test_tp3_answers_like_tp1(tp_cluster: tuple[str, str]) -> None:
    base_url, decode_metrics = tp_cluster
    client = OpenAI(base_url=base_url, api_key="unused", timeout=300)
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=48)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.content == _local_greedy(FRANCE, 48)
    # The long prompt goes through the TP=3 prefill worker and its KV to the TP=3 decode one.
    long = client.chat.completions.create(model=MODEL, messages=LONG, temperature=0, max_tokens=24)
    assert long.choices[0].message.content == _local_greedy(LONG, 24)
    text = httpx.get(decode_metrics, timeout=10).text
    assert 'tandem_worker_prefill_total{where="remote"} 1.0' in text
    for rank in range(3):  # every rank ran steps, and reports its broadcast wait
        assert f'tandem_worker_tp_broadcast_wait_seconds_total{{rank="{rank}"}}' in text
        steps = next(line for line in text.splitlines()
                     if line.startswith(f'tandem_worker_tp_steps_total{{rank="{rank}"}}'))
        assert float(steps.rsplit(" ", 1)[1]) > 0
