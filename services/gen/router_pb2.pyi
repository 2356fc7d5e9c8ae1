from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "local_hashes", "exclude_workers")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_HASHES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    local_hashes: _containers.RepeatedScalarFieldContainer[int]
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., local_hashes: _Optional[_Iterable[int]] = ..., exclude_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("worker_id", "overlap_blocks", "request_blocks", "prefix_hit_rate", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    overlap_blocks: int
    request_blocks: int
    prefix_hit_rate: float
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., overlap_blocks: _Optional[int] = ..., request_blocks: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., address: _Optional[str] = ...) -> None: ...

class RequestUpdate(_message.Message):
    __slots__ = ("request_id", "phase")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[RequestUpdate.Phase]
        PREFILLED: _ClassVar[RequestUpdate.Phase]
        FINISHED: _ClassVar[RequestUpdate.Phase]
    PHASE_UNSPECIFIED: RequestUpdate.Phase
    PREFILLED: RequestUpdate.Phase
    FINISHED: RequestUpdate.Phase
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    phase: RequestUpdate.Phase
    def __init__(self, request_id: _Optional[str] = ..., phase: _Optional[_Union[RequestUpdate.Phase, str]] = ...) -> None: ...

class UpdateAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
