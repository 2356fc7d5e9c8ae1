"""Stage 1: a request's prompt as token ids. Checks the model name, that exactly one of
messages, prompt or token ids is given, the chat roles, the vocabulary, the images, and
that at least one token is left to generate within the context."""

from __future__ import annotations

from dataclasses import dataclass

from services.api.images import PromptImage
from services.api.processor import CHAT_ROLES, ProcessRequest
from services.common.errors import InvalidRequest, ModelNotFound
from services.model.chat_template import ChatTemplateError
from services.model.tokenizer import Tokenizer
from services.processor.images import ImagePrompting
from services.processor.tools import tool_dicts, with_tool_prompt


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]  # image placeholders widened
    images: tuple[PromptImage, ...] = ()


class PromptStage:
    """``images``: how the model's prompt holds images (None: a text-only model)."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, context_length: int,
                 images: ImagePrompting | None = None) -> None:
        self._tok = tokenizer
        self._model_name = model_name
        self._context_length = context_length
        self._images = images

    def build(self, req: ProcessRequest) -> Prompt:
        """The prompt's ids and images; InvalidRequest or ModelNotFound for a request that
        cannot start."""
        if not req.messages or not any(m.images for m in req.messages):
            ids = self._ids(req)
            if self._images is not None and self._images.image_token_id in ids:
                raise InvalidRequest(f"the prompt holds the image token {self._images.image_token!r} but no "
                                     f"image; send images as image_url content parts", param="messages")
            return Prompt(ids)
        if self._images is None:
            raise InvalidRequest(f"the model {self._model_name!r} does not accept images",
                                 param="messages", code="image_input_not_supported")
        ids = self._ids(req, self._images)
        try:
            full, images = self._images.expand(ids, req.messages)
        except ValueError as e:
            raise InvalidRequest(f"messages: {e} (is the image token {self._images.image_token!r} "
                                 f"written in the text?)", param="messages") from None
        self._check_length(full, "messages")
        return Prompt(full, images)

    def _ids(self, req: ProcessRequest, images: ImagePrompting | None = None) -> list[int]:
        if req.model and req.model != self._model_name:
            raise ModelNotFound(f"the model {req.model!r} does not exist; this cluster serves "
                                f"{self._model_name!r}", param="model", code="model_not_found")
        given = [x is not None for x in (req.messages, req.prompt, req.prompt_ids)]
        if sum(given) != 1:
            raise InvalidRequest("give exactly one of messages, prompt or prompt token ids")
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequest("messages must not be empty", param="messages")
            for i, m in enumerate(req.messages):
                if m.role not in CHAT_ROLES:
                    raise InvalidRequest(f"messages.{i}.role: {m.role!r} is not one of "
                                         f"{sorted(CHAT_ROLES)}", param=f"messages.{i}.role")
            msgs = [{"role": x.role, "content": images.render_content(x) if images else x.content}
                    for x in req.messages]
            extra: dict = {}
            if req.tools and req.tool_choice.mode != "none":
                if self._tok.template_takes_tools:
                    extra["tools"] = tool_dicts(req.tools)
                else:
                    msgs = with_tool_prompt(msgs, req.tools)
            try:
                ids = self._tok.encode(self._tok.apply_chat_template(msgs, **extra))
            except (ChatTemplateError, ValueError, TypeError) as e:
                # NOTE: TypeError: the tokenizer's answer to text that is not valid Unicode
                # (a lone surrogate), which only an in-process caller can pass.
                raise InvalidRequest(f"cannot apply the chat template: {e}", param="messages") from None
            param = "messages"
        elif req.prompt is not None:
            try:
                ids, param = self._tok.encode(req.prompt), "prompt"
            except (ValueError, TypeError) as e:
                raise InvalidRequest(f"cannot tokenize the prompt: {e}", param="prompt") from None
        else:
            ids, param = list(req.prompt_ids or ()), "prompt"
            bad = [t for t in ids if not 0 <= t < self._tok.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary "
                                     f"[0, {self._tok.vocab_size})", param="prompt")
        if not ids:
            raise InvalidRequest("the prompt is empty", param=param)
        self._check_length(ids, param)
        return ids

    def _check_length(self, ids: list[int], param: str) -> None:
        if len(ids) >= self._context_length:
            raise InvalidRequest(
                f"This model's maximum context length is {self._context_length} tokens, but the "
                f"prompt has {len(ids)} tokens (at least one token must be left to generate)",
                param=param, code="context_length_exceeded")
