"""Moving requests off a draining decode worker on the real SmolLM2 (torch engines, real
gRPC over TCP): a seeded sampled request and a JSON-schema-constrained one, each moved
mid-stream, give exactly the text of an undisturbed run; the target imports their KV and
prefills nothing; no KV block is left held on either worker."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from services.api.processor import ChatMessage, ProcessRequest
from services.api.sampling import SamplingParams
from services.api.structured import StructuredOutput
from services.common.address_book import ChannelPool
from services.common.discovery import Registration
from services.engine.factory import build_engine
from services.model.tokenizer import Tokenizer
from tests.support.mock_cluster import MODEL, mock_cluster_cfg
from tests.support.moves import assert_no_leaks, metric, prefill_steps, run_draining_after
from tests.support.stack import RecordingRouter, make_processor, worker_decode_node

pytestmark = pytest.mark.asyncio

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "rain": {"type": "boolean"},
                                           "note": {"type": "string", "maxLength": 60}},
          "required": ["city", "rain", "note"], "additionalProperties": False}


def _request(rid: str, constrained: bool) -> ProcessRequest:
    if constrained:
        text = ("Pick a city anywhere in the world and answer as JSON with the fields city, "
                "rain and a short note about the weather there.")
        sp = SamplingParams(max_tokens=48, temperature=1.0, seed=11,
                            structured=StructuredOutput.json_schema(SCHEMA))
    else:
        text = "Tell me a short story about a lighthouse keeper."
        sp = SamplingParams(max_tokens=40, temperature=1.0, seed=1234, ignore_eos=True)
    return ProcessRequest(rid, messages=(ChatMessage("user", text),), model=MODEL, sampling=sp)


@pytest.mark.parametrize("constrained", [False, True], ids=["seeded", "json-schema"])
async def test_smollm2_moved_stream_equals_undisturbed(smollm2_path: Path, constrained: bool) -> None:
    cfg = mock_cluster_cfg(model={"path": str(smollm2_path)}, engine={
        "runner": "torch", "device": "cpu", "dtype": "float32", "quantization": "none",
        "block_size": 16, "num_kv_blocks": 64, "max_num_batched_tokens": 256,
        "max_model_len": 1024})
    tok = Tokenizer.from_path(smollm2_path)
    router = RecordingRouter(cfg)
    pool = ChannelPool()
    async with AsyncExitStack() as stack:
        nodes = []
        for i in range(2):
            engine = build_engine(cfg, worker_id=f"w{i}").engine
            nodes.append(await stack.enter_async_context(
                worker_decode_node(cfg, tok, f"w{i}", engine=engine)))
            router.worker_joined(Registration("decode", f"w{i}", address=nodes[i].address))
        p = make_processor(cfg, tok, router, 1024, pool)
        ref = [d async for d in p.generate(_request("ref", constrained))]
        before = {n.worker.worker_id: prefill_steps(n) for n in nodes}
        deltas, src = await asyncio.wait_for(
            run_draining_after(p, _request("mv", constrained), nodes, router, 6), 120)
        dst = next(n for n in nodes if n is not src)
        assert "mv" in dst.worker.generate_calls  # the stream really moved
        text = "".join(d.text for d in deltas)
        assert text == "".join(d.text for d in ref)
        assert deltas[-1].usage.completion_tokens == ref[-1].usage.completion_tokens > 6
        assert metric(src, "tandem_worker_requests_moved_total", outcome="pulled") == 1
        assert metric(dst, "tandem_worker_moves_received_total", outcome="imported") == 1
        assert prefill_steps(dst) == before[dst.worker.worker_id]  # its KV imported, not prefilled
        await assert_no_leaks(*nodes)
    await pool.close()
    if constrained:
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
