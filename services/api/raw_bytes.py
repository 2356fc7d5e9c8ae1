"""A serialized protobuf message's one large ``bytes`` field, without protobuf copying it:
the sender joins header bytes and the payload once (``with_bytes_field``), the receiver
takes a view of the payload in the received message (``split_bytes_field``) and parses the
rest. The results parse as the ordinary message (protobuf's wire format, any field order)."""

from __future__ import annotations


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def bytes_tag(field: int) -> bytes:
    """The key of a length-delimited field."""
    return varint(field << 3 | 2)


def with_bytes_field(head: bytes, field: int, data: memoryview | bytes) -> bytes:
    """``head`` (a serialized message without ``field``) plus ``field = data``: one copy of
    ``data``."""
    return b"".join((head, bytes_tag(field), varint(len(data)), data))


def split_bytes_field(raw: bytes, field: int) -> tuple[bytes, memoryview]:
    """A serialized message -> (its bytes without ``field``, a view of ``field`` in ``raw``;
    the last occurrence wins, as in protobuf). Raises ValueError on malformed wire data."""
    mv = memoryview(raw)
    rest: list[memoryview] = []
    data = mv[0:0]
    pos = 0
    while pos < len(mv):
        start = pos
        key, pos = _read_varint(mv, pos)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _read_varint(mv, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            n, pos = _read_varint(mv, pos)
            if key >> 3 == field:
                data = mv[pos:pos + n]
                if len(data) != n:
                    raise ValueError(f"truncated field {field}")
                pos += n
                continue
            pos += n
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        if pos > len(mv):
            raise ValueError("truncated field")
        rest.append(mv[start:pos])
    return b"".join(rest), data
