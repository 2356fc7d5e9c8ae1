"""proto/multimodal.proto <-> images.py and the processor's MessageImage (processor.py)."""

from __future__ import annotations

import hashlib

from services.api.images import ImageData
from services.api.processor import MessageImage
from services.gen import multimodal_pb2


def image_to_pb(im: ImageData) -> multimodal_pb2.ImageInput:
    return multimodal_pb2.ImageInput(data=im.data, content_hash=im.content_hash)


def image_from_pb(m: multimodal_pb2.ImageInput) -> ImageData:
    """The image's bytes and hash; the sender checked the image, so its pixels are not read
    again here (width/height 0). Raises ValueError when the hash does not match the bytes."""
    digest = hashlib.sha256(m.data).hexdigest()
    if m.content_hash != digest:
        raise ValueError(f"image content_hash {m.content_hash[:12]!r} does not match its bytes")
    return ImageData(m.data, digest, 0, 0)


def message_images_to_pb(images: tuple[MessageImage, ...]) -> list[multimodal_pb2.MessageImage]:
    return [multimodal_pb2.MessageImage(char_offset=x.char_offset, image=image_to_pb(x.image)) for x in images]


def message_images_from_pb(images) -> tuple[MessageImage, ...]:
    return tuple(MessageImage(x.char_offset, image_from_pb(x.image)) for x in images)
