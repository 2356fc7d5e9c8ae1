from services.gen import multimodal_pb2 as _multimodal_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EmbeddingTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "image", "sent_tokens", "capacity_tokens", "shm_host_id", "shm_name", "shm_offset", "shm_size")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHM_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    image: _multimodal_pb2.ImageInput
    sent_tokens: int
    capacity_tokens: int
    shm_host_id: str
    shm_name: str
    shm_offset: int
    shm_size: int
    def __init__(self, transfer_id: _Optional[str] = ..., image: _Optional[_Union[_multimodal_pb2.ImageInput, _Mapping]] = ..., sent_tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., shm_host_id: _Optional[str] = ..., shm_name: _Optional[str] = ..., shm_offset: _Optional[int] = ..., shm_size: _Optional[int] = ...) -> None: ...

class EmbeddingChunk(_message.Message):
    __slots__ = ("data", "rows", "hidden", "total_tokens", "offset", "is_last", "dtype", "in_shm", "byte_offset")
    DATA_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    IN_SHM_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    rows: int
    hidden: int
    total_tokens: int
    offset: int
    is_last: bool
    dtype: str
    in_shm: bool
    byte_offset: int
    def __init__(self, data: _Optional[bytes] = ..., rows: _Optional[int] = ..., hidden: _Optional[int] = ..., total_tokens: _Optional[int] = ..., offset: _Optional[int] = ..., is_last: _Optional[bool] = ..., dtype: _Optional[str] = ..., in_shm: _Optional[bool] = ..., byte_offset: _Optional[int] = ...) -> None: ...

class AbortTransferRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class AbortTransferReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
