"""`tandem up -c configs/multimodal.yaml` with the tiny random LLaVA model (real nats-server,
router, encode worker, decode worker, processor, frontend), driven with the openai client:
an image request gives transformers' greedy text with a remote encode worker (a small
default buffer: every image resumes) and with local encode (no resume); the same image
again is a prefix hit; no embedding block stays held."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support.llava import data_url, hf_greedy_text, image_png, make_model
from tests.support.ports import free_port
from tests.support.up import metric, start_up

ROOT = Path(__file__).resolve().parents[3]
MODEL = "tandem-tiny-random-llava"
MAX_NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / MODEL)


@pytest.fixture(scope="module", params=["remote-encode-resume", "local-encode"])
def cluster(request, model_dir: Path, tmp_path_factory) -> Iterator[tuple[str, str, str | None]]:
    remote = request.param.startswith("remote")
    ports = {k: free_port() for k in ("nats", "router", "router_m", "decode", "decode_m", "proc", "proc_m",
                                       "front", "launcher_m", "encode", "encode_m")}
    sets = [
        f"model.path={model_dir}", "engine.device=cpu", "engine.dtype=float32", "engine.block_size=4",
        f"nats.url=nats://127.0.0.1:{ports['nats']}", f"router.port={ports['router']}",
        f"router.metrics_port={ports['router_m']}", f"decode.port={ports['decode']}",
        f"decode.metrics_port={ports['decode_m']}", f"processor.port={ports['proc']}",
        f"processor.metrics_port={ports['proc_m']}", f"frontend.port={ports['front']}",
        f"launcher.metrics_port={ports['launcher_m']}", f"encode.port={ports['encode']}",
        f"encode.metrics_port={ports['encode_m']}", f"encode.replicas={1 if remote else 0}",
        # 16 rows per image; remote: a 4-row first buffer, so every image resumes.
        "multimodal.block_size=4", f"multimodal.default_blocks={1 if remote else 8}",
    ]
    up = start_up(ROOT / "configs" / "multimodal.yaml", tmp_path_factory.mktemp("mm") / "run",
                  ["--ready-timeout", "300", "--fail-fast"], sets)
    try:
        up.wait_for(r"^tandem is ready in", timeout=320)
        yield (f"http://127.0.0.1:{ports['front']}/v1", f"http://127.0.0.1:{ports['decode_m']}/metrics",
               f"http://127.0.0.1:{ports['encode_m']}/metrics" if remote else None)
    finally:
        assert up.stop(timeout=90) == 0, up.output()


def _ask(client: OpenAI, png: bytes):
    content = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": data_url(png)}},
               {"type": "text", "text": " What is it?"}]
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True})


def test_image_request_equals_transformers_and_hits_the_prefix_cache(cluster, model_dir):
    base_url, decode_metrics, encode_metrics = cluster
    client = OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    png = image_png((180, 60, 20))
    first = _ask(client, png)
    assert first.choices[0].message.content == hf_greedy_text(model_dir, "Look: ", [png], " What is it?", MAX_NEW)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = _ask(client, png)
    assert again.choices[0].message.content == first.choices[0].message.content
    n = first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 4 * 4
    assert metric(decode_metrics, "tandem_worker_mm_blocks_used") == 0
    if encode_metrics is not None:  # the encode worker did the work, once (then its cache)
        assert metric(encode_metrics, "tandem_encode_images_total") == 1
        assert metric(encode_metrics, "tandem_encode_cache_hits_total") == 1
        assert metric(encode_metrics, "tandem_worker_mm_blocks_used") == 0
