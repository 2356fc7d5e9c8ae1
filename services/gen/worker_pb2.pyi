from services.gen import request_pb2 as _request_pb2
from services.gen import multimodal_pb2 as _multimodal_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MoveSource(_message.Message):
    __slots__ = ("worker_id", "address", "move_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MOVE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    move_token: bytes
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., move_token: _Optional[bytes] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "images", "move_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    MOVE_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _request_pb2.SamplingParams
    images: _containers.RepeatedCompositeFieldContainer[_multimodal_pb2.PromptImage]
    move_from: MoveSource
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_request_pb2.SamplingParams, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_multimodal_pb2.PromptImage, _Mapping]]] = ..., move_from: _Optional[_Union[MoveSource, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "usage", "logprobs", "index", "prompt_logprobs", "moved")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _request_pb2.FinishReason
    usage: _request_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_request_pb2.TokenLogprob]
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_request_pb2.TokenLogprob]
    moved: MoveSource
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_request_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_request_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_request_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_request_pb2.TokenLogprob, _Mapping]]] = ..., moved: _Optional[_Union[MoveSource, _Mapping]] = ...) -> None: ...

class MoveKvRequest(_message.Message):
    __slots__ = ("request_id", "move_token", "first_block", "num_blocks", "num_tokens", "transfer_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MOVE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    move_token: bytes
    first_block: int
    num_blocks: int
    num_tokens: int
    transfer_token: bytes
    def __init__(self, request_id: _Optional[str] = ..., move_token: _Optional[bytes] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., transfer_token: _Optional[bytes] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("request_id", "first_token", "first_block", "num_blocks", "dtype", "shape", "prefill_worker_id", "offset", "data", "shm_name", "shm_offset", "shm_size", "transfer_token", "first_logprob")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    first_block: int
    num_blocks: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    prefill_worker_id: str
    offset: int
    data: bytes
    shm_name: str
    shm_offset: int
    shm_size: int
    transfer_token: bytes
    first_logprob: _request_pb2.TokenLogprob
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., prefill_worker_id: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., shm_name: _Optional[str] = ..., shm_offset: _Optional[int] = ..., shm_size: _Optional[int] = ..., transfer_token: _Optional[bytes] = ..., first_logprob: _Optional[_Union[_request_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class KvTransferAck(_message.Message):
    __slots__ = ("accepted", "error", "bytes_received")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    bytes_received: int
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ..., bytes_received: _Optional[int] = ...) -> None: ...
