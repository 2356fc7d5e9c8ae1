"""proto/processor.proto <-> processor.py: the frontend -> processor hop."""

from __future__ import annotations

from services.api.images_codec import message_images_from_pb, message_images_to_pb
from services.api.processor import (
    ChatMessage,
    Delta,
    ModelInfo,
    ProcessRequest,
    TextLogprob,
    Tool,
    ToolCall,
    ToolChoice,
)
from services.api.request_codec import (
    finish_from_pb,
    finish_to_pb,
    request_sampling_from_pb,
    sampling_to_pb,
    usage_from_pb,
    usage_to_pb,
)
from services.gen import processor_pb2

_TOOL_MODES = ("none", "auto", "required", "function")


def request_to_pb(req: ProcessRequest) -> processor_pb2.ProcessRequest:
    msg = processor_pb2.ProcessRequest(request_id=req.request_id, model=req.model,
                                       sampling=sampling_to_pb(req.sampling),
                                       tool_choice=processor_pb2.ToolChoice(
                                           mode=req.tool_choice.mode, name=req.tool_choice.name))
    msg.tools.extend(processor_pb2.Tool(name=t.name, description=t.description,
                                        parameters=t.parameters) for t in req.tools)
    msg.echo = req.echo
    msg.single_tool_call = not req.parallel_tool_calls
    if req.messages is not None:
        msg.chat.messages.extend(processor_pb2.ChatMessage(role=m.role, content=m.content,
                                                           images=message_images_to_pb(m.images))
                                 for m in req.messages)
    elif req.prompt is not None:
        msg.prompt = req.prompt
    elif req.prompt_ids is not None:
        msg.prompt_ids.ids.extend(req.prompt_ids)
    return msg


def request_from_pb(m: processor_pb2.ProcessRequest) -> ProcessRequest:
    """Raises ValueError naming a bad field."""
    which = m.WhichOneof("input")
    mode = m.tool_choice.mode or "auto"
    if mode not in _TOOL_MODES:
        raise ValueError(f"tool_choice.mode: {mode!r} is not one of {list(_TOOL_MODES)}")
    return ProcessRequest(
        tools=tuple(Tool(t.name, t.description, t.parameters) for t in m.tools),
        tool_choice=ToolChoice(mode, m.tool_choice.name),  # type: ignore[arg-type]
        request_id=m.request_id, model=m.model,
        sampling=request_sampling_from_pb(m.request_id, m.sampling),
        messages=tuple(ChatMessage(x.role, x.content, message_images_from_pb(x.images))
                       for x in m.chat.messages)
        if which == "chat" else None,
        prompt=m.prompt if which == "prompt" else None,
        prompt_ids=tuple(m.prompt_ids.ids) if which == "prompt_ids" else None,
        echo=m.echo, parallel_tool_calls=not m.single_tool_call,
    )


def delta_to_pb(d: Delta) -> processor_pb2.ProcessResponse:
    msg = processor_pb2.ProcessResponse(text=d.text, finish_reason=finish_to_pb(d.finish_reason),
                                        index=d.index, tokens=d.tokens,
                                        prompt_tokens=d.prompt_tokens)
    msg.tool_calls.extend(processor_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                          for c in d.tool_calls)
    if d.usage is not None:
        msg.usage.CopyFrom(usage_to_pb(d.usage))
    msg.logprobs.extend(
        processor_pb2.TextLogprob(token=x.token, logprob=x.logprob,  # None: left unset
                                  top_tokens=[t for t, _ in x.top],
                                  top_logprobs=[v for _, v in x.top],
                                  token_bytes=x.token_bytes, top_bytes=x.top_bytes)
        for x in d.logprobs)
    return msg


def delta_from_pb(m: processor_pb2.ProcessResponse) -> Delta:
    return Delta(m.text, finish_from_pb(m.finish_reason),
                 usage_from_pb(m.usage) if m.HasField("usage") else None,
                 tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                 tuple(TextLogprob(x.token, x.logprob if x.HasField("logprob") else None,
                                   tuple(zip(x.top_tokens, x.top_logprobs, strict=True)),
                                   x.token_bytes, tuple(x.top_bytes))
                       for x in m.logprobs),
                 m.index, m.tokens, m.prompt_tokens)


def models_to_pb(models: list[ModelInfo]) -> processor_pb2.ListModelsResponse:
    return processor_pb2.ListModelsResponse(models=[
        processor_pb2.ModelInfo(id=x.id, context_length=x.context_length) for x in models])


def models_from_pb(m: processor_pb2.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(x.id, x.context_length) for x in m.models]
