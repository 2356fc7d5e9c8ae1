"""`tandem up --set engine.stream_interval=3`: streamed answers, each chunk after the first
carrying several tokens, equal the unstreamed ones (greedy, with logprobs, cut by a stop
string), through the real model, processor, frontend and the `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support.mock_cluster import MODEL
from tests.support.up import FRANCE, REPO, local_ports, start_up

POEM = [{"role": "user", "content": "Write a long poem about the sea and its storms."}]


@pytest.fixture(scope="module")
def base_url(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ports, overrides = local_ports()
    # deterministic: a repeat of a prompt hits the prefix cache, and must give the same text
    overrides += ["engine.stream_interval=3", "engine.deterministic=true", "prefill.replicas=0",
                  "decode.disagg.enabled=false"]
    up = start_up(REPO / "configs" / "local.yaml", tmp_path_factory.mktemp("interval") / "run",
                  ["--ready-timeout", "300", "--fail-fast"], overrides)
    try:
        up.wait_for(r"^tandem is ready in", timeout=320)
        yield f"http://127.0.0.1:{ports['front']}/v1"
    finally:
        assert up.stop(timeout=120) == 0, up.output()


def test_streamed_chunks_of_three_tokens_equal_the_whole_answer(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", timeout=300)
    whole = client.chat.completions.create(model=MODEL, messages=POEM, temperature=0, max_tokens=30,
                                           logprobs=True)
    tokens = whole.usage.completion_tokens
    assert tokens == 30 and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=POEM, temperature=0, max_tokens=30,
                                                 logprobs=True, stream=True))
    content = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(c.delta.content for c in content) == whole.choices[0].message.content
    per_chunk = [len(c.logprobs.content) for c in content]
    assert sum(per_chunk) == tokens
    assert per_chunk[0] == 1 and all(n >= 3 for n in per_chunk[1:-1]), per_chunk  # first token alone
    assert [lp.token for c in content for lp in c.logprobs.content] == \
        [lp.token for lp in whole.choices[0].logprobs.content]
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


def test_a_stop_string_inside_a_chunk_cuts_the_stream_where_it_cuts_the_answer(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", timeout=300)
    full = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) > 3, text
    stop = words[3]
    cut = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30, stop=[stop])
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=30, stop=[stop], stream=True) if c.choices)
    assert cut.choices[0].finish_reason == "stop"
    assert streamed == cut.choices[0].message.content == text[:text.index(stop)]
