from services.gen import request_pb2 as _request_pb2
from services.gen import multimodal_pb2 as _multimodal_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "images")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    images: _containers.RepeatedCompositeFieldContainer[_multimodal_pb2.MessageImage]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_multimodal_pb2.MessageImage, _Mapping]]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ProcessRequest(_message.Message):
    __slots__ = ("request_id", "model", "chat", "prompt", "prompt_ids", "sampling", "tools", "tool_choice", "echo", "single_tool_call")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    SINGLE_TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    chat: ChatMessages
    prompt: str
    prompt_ids: TokenIds
    sampling: _request_pb2.SamplingParams
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    echo: bool
    single_tool_call: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_request_pb2.SamplingParams, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., echo: _Optional[bool] = ..., single_tool_call: _Optional[bool] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "name")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    mode: str
    name: str
    def __init__(self, mode: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ProcessResponse(_message.Message):
    __slots__ = ("text", "finish_reason", "usage", "tool_calls", "logprobs", "index", "tokens", "prompt_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    finish_reason: _request_pb2.FinishReason
    usage: _request_pb2.Usage
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    logprobs: _containers.RepeatedCompositeFieldContainer[TextLogprob]
    index: int
    tokens: int
    prompt_tokens: int
    def __init__(self, text: _Optional[str] = ..., finish_reason: _Optional[_Union[_request_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_request_pb2.Usage, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TextLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class TextLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs", "token_bytes", "top_bytes")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_BYTES_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[str]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_bytes: bytes
    top_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[str]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., token_bytes: _Optional[bytes] = ..., top_bytes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "context_length")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    id: str
    context_length: int
    def __init__(self, id: _Optional[str] = ..., context_length: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
