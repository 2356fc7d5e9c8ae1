"""A generated token's logprobs as text, for a ``Delta``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.api.outputs import TokenLogprob
from services.api.processor import TextLogprob


class TokenText(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def text_logprob(tok: TokenText, lp: TokenLogprob) -> TextLogprob:
    # NOTE: special tokens are kept (an EOS has a logprob too); a token that is part
    # of a multi-byte character decodes to U+FFFD, as in vLLM, and its bytes are its own.
    dec = tok.decode
    return TextLogprob(dec([lp.token_id], skip_special_tokens=False), lp.logprob,
                       tuple((dec([t], skip_special_tokens=False), x) for t, x in lp.top),
                       tok.token_bytes(lp.token_id), tuple(tok.token_bytes(t) for t, _ in lp.top))
