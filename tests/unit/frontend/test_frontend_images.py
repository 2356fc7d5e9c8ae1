"""Image content parts at the HTTP edge: PNG/JPEG/WebP data URLs reach the processor as
checked images placed in the text; remote URLs, corrupt images and limits are 400s naming
the part."""

from __future__ import annotations

import base64
import hashlib
import io

import httpx
import pytest
from PIL import Image

from services.api.outputs import FinishReason, Usage
from services.api.processor import Delta, ModelInfo, ProcessRequest
from services.common.config import ClusterConfig, MultimodalConfig
from services.frontend.app import create_app
from services.frontend.images import resolve_images


class FakeProcessor:
    def __init__(self) -> None:
        self.seen: list[ProcessRequest] = []

    async def generate(self, req: ProcessRequest):
        self.seen.append(req)
        yield Delta("ok", FinishReason.STOP, Usage(1, 1))

    async def list_models(self) -> list[ModelInfo]:
        return [ModelInfo("m", 128)]


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 6), color=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


async def post(content, **mm) -> tuple[httpx.Response, FakeProcessor]:
    cfg = ClusterConfig(multimodal=MultimodalConfig(**mm))
    proc = FakeProcessor()
    app = create_app(cfg, proc)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions",
                         json={"model": "m", "messages": [{"role": "user", "content": content}]})
    return r, proc


def assert_400(r: httpx.Response, param: str, text: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err


async def test_png_jpeg_webp_parts_reach_the_processor_in_place():
    imgs = [image_bytes("PNG"), image_bytes("JPEG"), image_bytes("WEBP")]
    content = [{"type": "text", "text": "a"}, part(data_url(imgs[0])), {"type": "text", "text": "bc"},
               part(data_url(imgs[1], "image/jpeg")), part(data_url(imgs[2], "image/webp")),
               {"type": "text", "text": "d"}]
    r, proc = await post(content)
    assert r.status_code == 200, r.text
    (msg,) = proc.seen[0].messages
    assert msg.content == "abcd"
    assert [x.char_offset for x in msg.images] == [1, 3, 3]
    assert [x.image.content_hash for x in msg.images] == [hashlib.sha256(b).hexdigest() for b in imgs]
    assert (msg.images[0].image.width, msg.images[0].image.height) == (8, 6)


async def test_remote_url_refused_unless_allowed():
    r, proc = await post([{"type": "text", "text": "x"}, part("https://example.com/cat.png")])
    assert_400(r, "messages.0.content.1.image_url.url", "allow_remote_urls")
    assert not proc.seen


@pytest.mark.parametrize("url,text", [
    (data_url(b"\x89PNG\r\n\x1a\nnot really a png"), "cannot be decoded"),
    (data_url(image_bytes("PNG")[:40]), "cannot be decoded"),  # truncated
    (data_url(image_bytes("GIF"), "image/gif"), "format GIF"),
    ("data:image/png;base64,@@@", "base64"),
    ("data:image/png,rawbytes", "base64-encoded"),
    ("ftp://x/y.png", "data:image"),
])
async def test_bad_images_are_400s_naming_the_part(url, text):
    r, proc = await post([part(url)])
    assert_400(r, "messages.0.content.0.image_url.url", text)
    assert not proc.seen


async def test_limits():
    r, _ = await post([part(data_url(image_bytes()))] * 3, max_images_per_request=2)
    assert_400(r, "messages", "at most 2")
    r, _ = await post([part(data_url(image_bytes(size=(100, 100))))], max_image_pixels=5000)
    assert_400(r, "messages.0.content.0.image_url.url", "100x100")
    big = image_bytes(size=(64, 64))
    r, _ = await post([part(data_url(big))], max_image_bytes=len(big) - 1)
    assert_400(r, "messages.0.content.0.image_url.url", "bytes")


async def test_allowed_remote_urls_are_fetched_within_limits():
    png = image_bytes()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ok.png":
            return httpx.Response(200, content=png)
        if request.url.path == "/big.png":
            return httpx.Response(200, content=png * 50)
        return httpx.Response(404)

    mm = MultimodalConfig(allow_remote_urls=True, max_image_bytes=len(png) * 10)
    t = httpx.MockTransport(handler)
    got = await resolve_images([(0, 0, "https://h/ok.png")], mm, t)
    assert got[(0, 0)].data == png
    from services.common.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="over"):
        await resolve_images([(0, 1, "https://h/big.png")], mm, t)
    with pytest.raises(InvalidRequest, match="HTTP 404") as e:
        await resolve_images([(2, 0, "http://h/missing.png")], mm, t)
    assert e.value.param == "messages.2.content.0.image_url.url"
