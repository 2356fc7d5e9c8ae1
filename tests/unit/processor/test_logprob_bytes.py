"""Logprob ``bytes`` are each token's raw bytes (real SmolLM2 tokenizer): the tokens of a
character split over several decode alone to U+FFFD, and their bytes, joined, are the
character's UTF-8; top alternatives the same; through the processor codec to the chat body."""

from __future__ import annotations

from pathlib import Path

from services.api.outputs import TokenLogprob
from services.api.processor import Delta
from services.api.processor_codec import delta_from_pb, delta_to_pb
from services.frontend.render import Renderer
from services.model.tokenizer import Tokenizer
from services.processor.stages.logprobs import text_logprob


def test_chat_logprob_bytes_of_a_split_character(smollm2_path: Path) -> None:
    tok = Tokenizer.from_path(smollm2_path)
    ids = tok.encode(" 日本")
    lps = tuple(text_logprob(tok, TokenLogprob(t, -0.5, ((t, -0.5), (2, -3.0)))) for t in ids)
    assert "\ufffd" in "".join(x.token for x in lps)
    lps = delta_from_pb(delta_to_pb(Delta("", logprobs=lps))).logprobs
    body = Renderer(True, "chatcmpl-x", "m", logprobs=True).logprobs_body(lps)
    assert body is not None
    content = body["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode() == " 日本"
    for e, t in zip(content, ids, strict=True):
        assert e["bytes"] == list(tok.token_bytes(t))
        assert [x["bytes"] for x in e["top_logprobs"]] == [list(tok.token_bytes(t)), list(b"<|im_end|>")]
