from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageInput(_message.Message):
    __slots__ = ("data", "content_hash")
    DATA_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    content_hash: str
    def __init__(self, data: _Optional[bytes] = ..., content_hash: _Optional[str] = ...) -> None: ...

class MessageImage(_message.Message):
    __slots__ = ("char_offset", "image")
    CHAR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    char_offset: int
    image: ImageInput
    def __init__(self, char_offset: _Optional[int] = ..., image: _Optional[_Union[ImageInput, _Mapping]] = ...) -> None: ...

class PromptImage(_message.Message):
    __slots__ = ("offset", "length", "image")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    image: ImageInput
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., image: _Optional[_Union[ImageInput, _Mapping]] = ...) -> None: ...
