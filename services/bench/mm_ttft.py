"""`tandem bench mm-ttft --base-url URL --model M`: time to first token of image requests
while text requests keep the cluster busy.

``--text-concurrency`` text chat requests are kept in flight throughout; meanwhile
``--images`` streaming image requests go one after another, each with a new PNG (no
embedding-cache or prefix hit), and each one's TTFT (request sent -> first content chunk)
is recorded. Run it against a cluster with ``encode.replicas: 1`` (remote encode) and one
with ``encode.replicas: 0`` (the decode worker encodes) to compare; ``--label`` names the run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time

import httpx

from services.bench.results import finish, header, write_json


def _png(i: int, size: int) -> str:
    from PIL import Image

    img = Image.new("RGB", (size, size), ((37 * i) % 256, (91 * i) % 256, (53 * i + 7) % 256))
    img.putpixel((i % size, (i // size) % size), (255, 255, 255))  # every image distinct
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _image_ttft(client: httpx.AsyncClient, model: str, url: str) -> float:
    body = {"model": model, "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Describe the image."}, {"type": "image_url", "image_url": {"url": url}}]}]}
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"image request: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: ") and '"content"' in line:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("image request streamed no content")
    return ttft


async def _run(base_url: str, model: str, images: int, size: int, concurrency: int, text_tokens: int) -> dict:
    stop = asyncio.Event()
    text_done = text_failed = 0

    async def text_load(client: httpx.AsyncClient, k: int) -> None:
        nonlocal text_done, text_failed
        n = 0
        while not stop.is_set():
            body = {"model": model, "max_tokens": text_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Write about topic {k}-{n}."}]}
            r = await client.post("/v1/chat/completions", json=body)
            text_done += r.status_code == 200
            text_failed += r.status_code != 200
            n += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        loaders = [asyncio.create_task(text_load(client, k)) for k in range(concurrency)]
        try:
            await asyncio.sleep(1.0)  # let the load reach the workers
            ttfts = [await _image_ttft(client, model, _png(i, size)) for i in range(images)]
        finally:
            stop.set()
            await asyncio.gather(*loaders, return_exceptions=True)
    ttfts.sort()
    return {"image_ttft_s": {"median": round(statistics.median(ttfts), 4),
                             "p90": round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 4),
                             "mean": round(statistics.fmean(ttfts), 4), "max": round(ttfts[-1], 4)},
            "images": images, "image_size": size, "text_concurrency": concurrency,
            "text_requests_done": text_done, "text_requests_failed": text_failed}


def main(args: argparse.Namespace) -> int:
    if args.images < 1 or args.image_size < 1 or args.text_concurrency < 0:
        raise SystemExit("--images and --image-size must be >= 1, --text-concurrency >= 0")
    head = header(args)
    result = asyncio.run(_run(args.base_url.rstrip("/"), args.model, args.images, args.image_size,
                              args.text_concurrency, args.text_tokens))
    result = finish(head, {"label": args.label, **result})
    print(json.dumps(result, indent=2))
    write_json(args.json_path, result)
    return 0
