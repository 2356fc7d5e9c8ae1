"""The processor's side of tool calling, with the real SmolLM2 tokenizer and a scripted
decode worker: the tools reach the prompt (SmolLM2's template has none, so the standard
system prompt), ``auto`` answers parse into calls at the end of the stream, content before
a call streams, and a text that is no call stays text; ``none`` leaves the prompt alone."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from services.api.outputs import FinishReason, TokenOutput
from services.api.processor import ChatMessage, Delta, ProcessRequest, Tool, ToolChoice
from services.api.sampling import SamplingParams
from services.common.discovery import Registration
from services.model.tokenizer import Tokenizer
from services.processor.processor import Processor
from services.router.router import Router
from tests.support.mock_cluster import MODEL, mock_cluster_cfg

WEATHER = Tool("get_weather", "Weather of a city", json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_path)


class ScriptedWorker:
    """Answers with the tokens of ``text``, two per message; keeps the prompts it got."""

    def __init__(self, tok: Tokenizer, text: str) -> None:
        self.ids = tok.encode(text)
        self.prompts: list[list[int]] = []

    async def generate(self, address: str, request_id: str, token_ids: Sequence[int],
                       sampling: SamplingParams) -> AsyncIterator[TokenOutput]:
        self.prompts.append(list(token_ids))
        for i in range(0, len(self.ids), 2):
            last = i + 2 >= len(self.ids)
            yield TokenOutput(request_id, self.ids[i:i + 2], last,
                              FinishReason.STOP if last else None, len(token_ids))


async def _run(tok: Tokenizer, text: str, choice: ToolChoice) -> tuple[list[Delta], ScriptedWorker]:
    cfg = mock_cluster_cfg()
    router = Router(cfg)
    router.worker_joined(Registration("decode", "w0", address="127.0.0.1:1"))
    worker = ScriptedWorker(tok, text)
    p = Processor(tok, router, worker, MODEL, 4096, cfg.engine.block_size)
    req = ProcessRequest("r", messages=(ChatMessage("user", "Weather in Paris?"),), model=MODEL,
                         sampling=SamplingParams(max_tokens=200), tools=(WEATHER,),
                         tool_choice=choice)
    return [d async for d in p.generate(req)], worker


async def test_auto_renders_the_tools_and_parses_the_call(tok: Tokenizer) -> None:
    text = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    deltas, worker = await _run(tok, text, ToolChoice("auto"))
    prompt = tok.decode(worker.prompts[0], skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert prompt.index("<tools>") < prompt.index("Weather in Paris?")
    *body, last = deltas
    assert "".join(d.text for d in deltas) == "Checking. "
    assert all(not d.tool_calls for d in body)
    assert last.finish_reason is FinishReason.STOP
    (call,) = last.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


async def test_auto_text_without_a_call_stays_text(tok: Tokenizer) -> None:
    text = "It is sunny in Paris, 3 < 4."
    deltas, _ = await _run(tok, text, ToolChoice("auto"))
    assert "".join(d.text for d in deltas) == text and not deltas[-1].tool_calls


async def test_none_keeps_the_tools_out_of_the_prompt(tok: Tokenizer) -> None:
    deltas, worker = await _run(tok, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
                                ToolChoice("none"))
    assert "<tools>" not in tok.decode(worker.prompts[0], skip_special_tokens=False)
    assert not deltas[-1].tool_calls and deltas[-1].finish_reason is FinishReason.STOP
