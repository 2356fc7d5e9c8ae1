"""The image parts of a chat request -> checked images (services/api/images.py).

A data URL is decoded; a remote http(s) URL is refused unless ``multimodal.allow_remote_urls``
(then fetched within ``remote_fetch_timeout_s`` and ``max_image_bytes``: an open fetcher is a
way into the cluster's network, so it is off by default). Every failure is a 400 naming the
part (``messages.{i}.content.{j}.image_url.url``)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import re

import httpx

from services.api.images import ImageData, ImageInputError
from services.common.config import MultimodalConfig
from services.common.errors import InvalidRequest

ImagesByPart = dict[tuple[int, int], ImageData]


async def resolve_images(urls: list[tuple[int, int, str]], mm: MultimodalConfig,
                         transport: httpx.AsyncBaseTransport | None = None) -> ImagesByPart:
    """``urls``: (message index, part index, url) of each image part."""
    if len(urls) > mm.max_images_per_request:
        raise InvalidRequest(f"messages: {len(urls)} images; at most {mm.max_images_per_request} per request "
                             f"(multimodal.max_images_per_request)", param="messages", code="too_many_images")
    out: ImagesByPart = {}
    for i, j, url in urls:
        param = f"messages.{i}.content.{j}.image_url.url"
        try:
            if is_remote(url):
                if not mm.allow_remote_urls:
                    raise ImageInputError("remote image URLs are not allowed here (multimodal.allow_remote_urls "
                                          "is off); send the image as a data:image/...;base64 URL")
                data = await fetch_image(url, mm.max_image_bytes, mm.remote_fetch_timeout_s, transport)
            else:
                data = data_url_bytes(url)
            out[(i, j)] = await asyncio.to_thread(ImageData.from_bytes, data, mm.max_image_bytes, mm.max_image_pixels)
        except ImageInputError as e:
            raise InvalidRequest(f"{param}: {e}", param=param, code="invalid_image") from None
    return out


async def fetch_image(url: str, max_bytes: int, timeout_s: float,
                      transport: httpx.AsyncBaseTransport | None = None) -> bytes:
    """GET ``url``; ImageInputError past ``max_bytes``, ``timeout_s`` in all, or on any failure."""
    async def get() -> bytes:
        async with httpx.AsyncClient(transport=transport, timeout=timeout_s, follow_redirects=False) as client:
            async with client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise ImageInputError(f"fetching the image gave HTTP {r.status_code}")
                got = bytearray()
                async for chunk in r.aiter_bytes():
                    got += chunk
                    if len(got) > max_bytes:
                        raise ImageInputError(f"the image is over {max_bytes} bytes")
                return bytes(got)

    try:
        return await asyncio.wait_for(get(), timeout_s)
    except TimeoutError:
        raise ImageInputError(f"fetching the image took over {timeout_s}s") from None
    except httpx.HTTPError as e:
        raise ImageInputError(f"cannot fetch the image: {type(e).__name__}: {e}") from None


_DATA_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]+)?(;[^,]*)?,", re.ASCII)


def data_url_bytes(url: str) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL; ImageInputError if it is not one."""
    m = _DATA_URL.match(url)
    if m is None:
        raise ImageInputError("the url must be a data:image/...;base64,... URL or an http(s) URL")
    if m.group(2) is None or "base64" not in m.group(2).split(";"):
        raise ImageInputError("a data URL must be base64-encoded (data:image/png;base64,...)")
    try:
        return base64.b64decode(url[m.end():], validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageInputError(f"the data URL's base64 is invalid: {e}") from None


def is_remote(url: str) -> bool:
    return url.startswith(("http://", "https://"))
