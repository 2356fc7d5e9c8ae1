"""SIGTERM drains: `tandem processor` and `tandem frontend` as real processes, with a router
and the real decode worker (slow mock steps) in this test. A stream that is running when
both processes get SIGTERM still completes (every token, finish reason, [DONE]); afterwards
the frontend takes no new requests, and both processes exit 0."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from services.common.config import parse_config
from services.model.tokenizer import Tokenizer
from tests.support.cluster import running_cluster
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.ports import free_port
from tests.support.procs import start_part, wait_http_ok, write_config
from tests.support.stack import worker_decode_node


async def test_sigterm_lets_the_running_stream_finish_then_exits_0(
        nats_url: str, smollm2_path: Path, tmp_path: Path) -> None:
    ns = "drain"
    cfg = mock_cluster_cfg(namespace=ns, nats={"url": nats_url},
                           engine={"mock": {"step_base_s": 0.03}})
    tok = Tokenizer.from_path(smollm2_path)
    async with running_cluster(cfg, tok, node_factory=lambda: worker_decode_node(cfg, tok)) as c:
        fe_port, p_port = free_port(), free_port()
        part_cfg = parse_config({}, [
            f"nats.url={nats_url}", f"namespace={ns}", f"model.name={MODEL}",
            f"processor.port={p_port}", f"processor.metrics_port={free_port()}",
            f"frontend.port={fe_port}", f"frontend.processor_address=127.0.0.1:{p_port}",
            "engine.max_model_len=512", "discovery.ttl_s=2", "discovery.heartbeat_s=0.5",
            # NOTE: a grace well below the 30 s this test waits for the exit: the lifecycle
            # bounds every step after the signal, so the exit comes within the grace plus
            # a few seconds even if an RPC never ends (the stream here needs about 2 s)
            "processor.drain_timeout_s=10", "frontend.drain_timeout_s=10"])
        cfg_file = write_config(part_cfg, tmp_path / "cluster.yaml")
        parts = [start_part(part, cfg_file, tmp_path) for part in ("processor", "frontend")]
        try:
            url = f"http://127.0.0.1:{fe_port}"
            # the frontend process reaches the processor process
            await asyncio.to_thread(wait_http_ok, url + "/v1/models", parts)
            body = {"model": MODEL, "stream": True, "max_tokens": 60, "temperature": 0,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": "Tell me a long story"}]}
            chunks, finish, done, usage = 0, None, False, None
            async with httpx.AsyncClient(timeout=60) as http:
                async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            assert "error" not in chunk, chunk
                            chunks += 1
                            usage = chunk.get("usage") or usage
                            if chunk["choices"]:
                                finish = chunk["choices"][0]["finish_reason"] or finish
                            if chunks == 2:  # mid-stream: stop both parts
                                for p in parts:
                                    p.terminate()
                                # NOTE: the processes drain concurrently with this stream.
            assert done and finish == "length" and usage["completion_tokens"] == 60
            codes = {p.name: await asyncio.to_thread(p.wait, 30) for p in parts}
            assert codes == {"processor-0": 0, "frontend-0": 0}, (
                codes, *(p.output()[-1500:] for p in parts))
            async with httpx.AsyncClient() as http:
                try:
                    late = await http.post(url + "/v1/chat/completions", json=body, timeout=2)
                    raise AssertionError(f"a request after the drain was served: {late.status_code}")
                except httpx.ConnectError:
                    pass
            await c.node.engine.check_integrity()
            assert c.node.engine.stats().kv_blocks_used == 0
        finally:
            for p in parts:
                p.kill9()
