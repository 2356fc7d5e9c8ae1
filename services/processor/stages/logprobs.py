"""A generated token's logprobs as text, for a ``Delta``."""

from __future__ import annotations

from services.api.outputs import TokenLogprob
from services.api.processor import TextLogprob
from services.processor.detokenizer import Decoder


def text_logprob(tok: Decoder, lp: TokenLogprob) -> TextLogprob:
    # NOTE: special tokens are kept (an EOS has a logprob too); a token that is part
    # of a multi-byte character decodes to U+FFFD, as in vLLM.
    dec = tok.decode
    return TextLogprob(dec([lp.token_id], skip_special_tokens=False), lp.logprob,
                       tuple((dec([t], skip_special_tokens=False), x) for t, x in lp.top))
