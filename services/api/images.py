"""An image as a request carries it: the file's bytes, checked (format, size, pixels) and
named by its content hash. Torch-free: the frontend decodes and checks, the worker that
encodes turns it into pixels."""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP")


class ImageInputError(ValueError):
    """The image cannot be used; the message says why (the caller names the part)."""


@dataclass(frozen=True, slots=True)
class ImageData:
    data: bytes  # the image file as sent (PNG, JPEG or WebP)
    content_hash: str  # hex sha256 of ``data``
    width: int
    height: int

    @classmethod
    def from_bytes(cls, data: bytes, max_bytes: int, max_pixels: int) -> ImageData:
        """Check ``data`` is a whole PNG/JPEG/WebP within the limits; ImageInputError if not."""
        if len(data) > max_bytes:
            raise ImageInputError(f"the image is {len(data)} bytes; the limit is {max_bytes}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(data))
                if img.format not in FORMATS:
                    raise ImageInputError(f"image format {img.format} is not supported ({', '.join(FORMATS)})")
                w, h = img.size
                # NOTE: before load(): the header's size decides, so a decompression bomb
                # is refused without being decompressed.
                if w * h > max_pixels:
                    raise ImageInputError(f"the image has {w}x{h} pixels; the limit is {max_pixels} pixels")
                img.load()
        except ImageInputError:
            raise
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError,
                Image.DecompressionBombWarning) as e:
            raise ImageInputError(f"the image cannot be decoded: {e}") from None
        return cls(data, hashlib.sha256(data).hexdigest(), w, h)

    def to_pil(self) -> Image.Image:
        return Image.open(io.BytesIO(self.data))


@dataclass(frozen=True, slots=True)
class PromptImage:
    """An image in a tokenized prompt: ``length`` placeholder tokens from ``offset``."""

    offset: int
    length: int
    image: ImageData

    @property
    def content_hash(self) -> str:
        return self.image.content_hash
