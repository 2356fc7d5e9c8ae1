"""Completions' ``echo``: each choice's first delta starts with the prompt's text and, with
``sampling.prompt_logprobs``, its logprobs with the prompt tokens' (the first token's
``None``: nothing predicts it, as OpenAI and vLLM report it).

The streaming stages hand the worker's prompt logprobs to ``take`` as they arrive (with
the request's first output, before any delta made from it); ``apply`` then runs on every
delta the processor sends, after the tool-call stage."""

from __future__ import annotations

from dataclasses import replace

from services.api.outputs import TokenLogprob
from services.api.processor import Delta, ProcessRequest, TextLogprob
from services.common.errors import Unavailable
from services.processor.stages.logprobs import TokenText, text_logprob
from services.processor.stages.prompt import Prompt


class Echo:
    def __init__(self, tokenizer: TokenText, req: ProcessRequest, prompt: Prompt) -> None:
        self._tok = tokenizer
        # NOTE: a text prompt is echoed as sent; token ids as their decoding.
        self._text = (req.prompt if req.prompt is not None
                      else tokenizer.decode(prompt.ids, skip_special_tokens=False))
        self._first_id = prompt.ids[0]
        self._want_logprobs = req.sampling.prompt_logprobs is not None
        self._logprobs: tuple[TextLogprob, ...] | None = None
        self._echoed: set[int] = set()  # choices whose first delta went out

    @classmethod
    def for_request(cls, tokenizer: TokenText, req: ProcessRequest, prompt: Prompt) -> Echo | None:
        return cls(tokenizer, req, prompt) if req.echo else None

    def take(self, prompt_logprobs: list[TokenLogprob] | None) -> None:
        """The worker's prompt logprobs (prompt token i's at [i - 1]), once."""
        if prompt_logprobs is None or self._logprobs is not None or not self._want_logprobs:
            return
        dec = self._tok.decode
        first = TextLogprob(dec([self._first_id], skip_special_tokens=False), None,
                            token_bytes=self._tok.token_bytes(self._first_id))
        self._logprobs = (first, *(text_logprob(self._tok, x) for x in prompt_logprobs))

    def apply(self, d: Delta) -> Delta:
        """``d``, with the echo in front when it is its choice's first delta."""
        if d.index in self._echoed or (d.usage is not None and d.finish_reason is None
                                       and not d.text):
            return d  # echoed already, or the request's closing usage delta
        self._echoed.add(d.index)
        lps: tuple[TextLogprob, ...] = ()
        if self._want_logprobs:
            if self._logprobs is None:
                raise Unavailable("the decode worker sent no prompt logprobs")
            lps = self._logprobs
        return replace(d, text=self._text + d.text, logprobs=lps + d.logprobs)
