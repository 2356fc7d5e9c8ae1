"""An image request through the frontend (openai client), the processor, the router and a
decode worker on real gRPC, with a tiny random LLaVA model: the same greedy text as
transformers' generate, with and without a resume of the embedding transfer; the same
image again is a prefix hit, another image is not; every embedding block is freed."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from services.api.kv_events import KvStored
from services.common.address_book import ChannelPool
from services.common.config import parse_config
from services.common.discovery import Registration
from services.decode.grpc_server import serve_decode_worker
from services.decode.worker import DecodeWorker
from services.engine.async_engine import AsyncEngine
from services.engine.factory import build_embedder, build_engine
from services.engine.multimodal.embedder import LocalEncodeChannel
from services.engine.multimodal.metrics import MmBlocksCollector
from services.frontend.app import create_app
from services.model.tokenizer import Tokenizer
from services.processor.images import ImagePrompting
from services.processor.processor import Processor
from services.processor.worker_client import DecodeWorkerClient
from tests.support.llava import data_url, encode_server, hf_greedy_text, image_png, make_model
from tests.support.stack import RecordingRouter

MAX_NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny-llava"))


@asynccontextmanager
async def stack(model_dir, default_blocks: int, images: bool = True, remote: bool = False,
                channel_cls=LocalEncodeChannel):
    if remote:
        async with encode_server(model_dir, channel_cls=channel_cls) as (local, grpc_channel, _), \
                _stack(model_dir, default_blocks, images, lambda: [grpc_channel]) as st:
            st.channel = local
            yield st
    else:
        async with _stack(model_dir, default_blocks, images, None) as got:
            yield got


@asynccontextmanager
async def _stack(model_dir, default_blocks: int, images: bool, remote):
    cfg = parse_config({
        "model": {"path": str(model_dir), "name": "tiny"},
        "engine": {"runner": "torch", "device": "cpu", "dtype": "float32", "block_size": 4,
                   "num_kv_blocks": 256, "max_num_batched_tokens": 64, "max_model_len": 512},
        "multimodal": {"block_size": 4, "default_blocks": default_blocks, "num_blocks": 64},
    })
    events: list = []
    parts = build_engine(cfg, "w0", on_kv_event=events.append)
    worker_images = build_embedder(cfg, parts.model_path, remote=remote)
    embedder, channel = worker_images.embedder, worker_images.local
    registry = CollectorRegistry()
    registry.register(MmBlocksCollector(*worker_images.allocators))
    pool = ChannelPool()
    async with AsyncEngine(parts.engine) as ae:
        worker = DecodeWorker(ae, cfg, "w0", None, embedder=embedder)
        server, port = await serve_decode_worker(worker, "127.0.0.1", 0)
        router = RecordingRouter(cfg)
        router.worker_joined(Registration("decode", "w0", address=f"127.0.0.1:{port}"))
        prompting = ImagePrompting.for_model(model_dir, parts.tokenizer.id_to_token) if images else None
        processor = Processor(parts.tokenizer, router, DecodeWorkerClient(pool), "tiny", 512, 4, images=prompting)
        app = create_app(cfg, processor)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
        try:
            yield SimpleNamespace(client=client, registry=registry, channel=channel, router=router, events=events)
        finally:
            await http.aclose()
            await server.stop(grace=0)
            await pool.close()
            worker_images.close()


def _message(text_before: str, pngs: list[bytes], text_after: str) -> list[dict]:
    parts = [{"type": "text", "text": text_before}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pngs]
    parts.append({"type": "text", "text": text_after})
    return [{"role": "user", "content": parts}]


async def _ask(client, pngs, before="Look: ", after=" What is it?"):
    return await client.chat.completions.create(
        model="tiny", messages=_message(before, pngs, after), max_tokens=MAX_NEW, temperature=0,
        extra_body={"ignore_eos": True})


# default_blocks 1 (4 rows) < 16 rows per image: every image resumes; 8 (32 rows): none does.
@pytest.mark.parametrize("remote", [False, True], ids=["local-encode", "remote-encode"])
@pytest.mark.parametrize("default_blocks", [1, 8], ids=["resume", "no-resume"])
async def test_greedy_text_equals_transformers(model_dir, default_blocks, remote):
    red, blue = image_png((200, 30, 30)), image_png((20, 40, 220), (17, 41))
    async with stack(model_dir, default_blocks, remote=remote) as st:
        one = await _ask(st.client, [red])
        two = await _ask(st.client, [red, blue])
        assert st.registry.get_sample_value("tandem_worker_mm_blocks_used") == 0
        assert st.channel.sender.in_flight == 0 and st.channel.sender.allocator.used_blocks == 0
    assert one.choices[0].message.content == hf_greedy_text(model_dir, "Look: ", [red], " What is it?", MAX_NEW)
    assert two.choices[0].message.content == hf_greedy_text(model_dir, "Look: ", [red, blue], " What is it?",
                                                            MAX_NEW)
    assert one.choices[0].message.content != two.choices[0].message.content or one.usage.prompt_tokens != \
        two.usage.prompt_tokens


def _feed_router(st) -> None:
    """What the router's KV-event ingest does, for the events the worker emitted so far."""
    for ev in st.events:
        if isinstance(ev, KvStored):
            st.router.index.apply_stored("w0", ev.parent_seq_hash, [b.seq_hash for b in ev.blocks],
                                         [b.local_hash for b in ev.blocks])
    st.events.clear()


async def test_same_image_is_a_prefix_hit_a_different_one_is_not(model_dir):
    red, green = image_png((200, 30, 30)), image_png((30, 200, 30))
    async with stack(model_dir, 1) as st:
        first = await _ask(st.client, [red])
        _feed_router(st)
        again = await _ask(st.client, [red])
        _feed_router(st)
        other = await _ask(st.client, [green])
        overlaps = [resp.overlap_blocks for _, resp in st.router.routed]
    n = first.usage.prompt_tokens
    tok = Tokenizer.from_path(model_dir)
    image_at = tok.encode_chat([{"role": "user", "content": "Look: <image> What is it?"}]).index(
        tok.token_to_id("<image>"))
    # The router saw the same: the processor's image-aware hashes meet the worker's events.
    assert overlaps == [0, (n - 1) // 4, image_at // 4]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 4 * 4  # all but the last block
    # The text before the image is shared; no block holding the image is.
    assert other.usage.prompt_tokens_details.cached_tokens == image_at // 4 * 4 > 0


async def test_text_only_model_refuses_images_with_400(model_dir):
    async with stack(model_dir, 8, images=False) as st:
        with pytest.raises(openai.BadRequestError) as e:
            await _ask(st.client, [image_png((1, 2, 3))])
    assert e.value.body["code"] == "image_input_not_supported"


async def test_image_token_typed_in_the_text_is_a_400(model_dir):
    async with stack(model_dir, 8) as st:
        with pytest.raises(openai.BadRequestError, match="image placeholders"):
            await _ask(st.client, [image_png((1, 2, 3))], before="see <image> and ")


async def test_image_token_without_an_image_is_a_400(model_dir):
    async with stack(model_dir, 8) as st:
        with pytest.raises(openai.BadRequestError, match="image_url content parts"):
            await st.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a <image> b"}],
                                                 max_tokens=2)


class HangingResume(LocalEncodeChannel):
    """An encode worker that never answers a resume (records aborts)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.aborted: list[str] = []
        self.reached = asyncio.Event()

    async def transfer(self, req):
        if req.sent_tokens > 0:
            self.reached.set()
            await asyncio.Event().wait()
        return await super().transfer(req)

    async def abort(self, req_id):
        self.aborted.append(req_id)
        await super().abort(req_id)


async def test_client_disconnect_cancels_the_encode(model_dir):
    async with stack(model_dir, 1, remote=True, channel_cls=HangingResume) as st:
        request = asyncio.create_task(_ask(st.client, [image_png((9, 9, 9))]))
        await st.channel.reached.wait()  # mid-transfer: the first chunk is in, the resume hangs
        request.cancel()  # the client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await request
        async def aborted() -> None:  # the cancellation travels frontend -> worker -> encode
            while not st.channel.aborted:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(aborted(), 60)  # a bound for a clean failure, not a timing
        assert st.channel.aborted[0].endswith("/0")
        assert st.channel.sender.allocator.used_blocks == 0 and st.channel.sender.in_flight == 0
        assert st.registry.get_sample_value("tandem_worker_mm_blocks_used") == 0
