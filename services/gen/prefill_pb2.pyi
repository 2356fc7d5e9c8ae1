from services.gen import request_pb2 as _request_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RemotePrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "decode_worker_id", "kv_transfer_address", "first_block", "num_blocks", "deadline_unix_ms", "attempt", "decode_host_id", "transfer_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    DECODE_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _request_pb2.SamplingParams
    decode_worker_id: str
    kv_transfer_address: str
    first_block: int
    num_blocks: int
    deadline_unix_ms: int
    attempt: int
    decode_host_id: str
    transfer_token: bytes
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_request_pb2.SamplingParams, _Mapping]] = ..., decode_worker_id: _Optional[str] = ..., kv_transfer_address: _Optional[str] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., attempt: _Optional[int] = ..., decode_host_id: _Optional[str] = ..., transfer_token: _Optional[bytes] = ...) -> None: ...
