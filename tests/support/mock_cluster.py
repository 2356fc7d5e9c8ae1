"""The one builder of a test cluster config: the mock runner with SmolLM2's vocabulary, fast
discovery, and, given a nats-server URL, a namespace of its own."""

from __future__ import annotations

import uuid
from typing import Any

from services.common.config import ClusterConfig, parse_config

MODEL = "SmolLM2-135M-Instruct"
# A model path that does not exist: a mock-runner part then loads no tokenizer and stops on
# the mock's own eos token (in-process engines and `tandem decode|prefill` processes).
NO_MODEL = "/nonexistent/tandem-test-model.gguf"

# SmolLM2's vocabulary and eos, so the real tokenizer decodes the mock's tokens; no per-token
# cost, so a step takes step_base_s whatever the batch.
MOCK_ENGINE: dict[str, Any] = {
    "runner": "mock", "block_size": 16, "num_kv_blocks": 256, "max_model_len": 512,
    "max_num_seqs": 16, "max_num_batched_tokens": 512,
    "mock": {"step_base_s": 0.002, "per_prefill_token_s": 0.0, "per_decode_seq_s": 0.0,
             "vocab_size": 49152, "eos_token_id": 2},
}

# Blocks of 4 and a 1000-token vocabulary: prompts of a few blocks give partial prefix hits
# (the disaggregation and KV tests). No tokenizer has this vocabulary: used with NO_MODEL.
SMALL_ENGINE: dict[str, Any] = {
    "block_size": 4, "num_kv_blocks": 128, "max_num_seqs": 8, "max_num_batched_tokens": 64,
    "mock": {"step_base_s": 0.0, "vocab_size": 1000},
}


# The tests of the remote path want a long prompt prefilled remotely whenever the bounds
# allow; the predict policy (which keeps a prompt local where that is sooner) has its own.
REMOTE_WHEN_ALLOWED: dict[str, Any] = {"decode": {"disagg": {"policy": "threshold"}}}


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in at every depth: a nested dict in ``over`` changes only
    the keys it names."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def mock_cluster_cfg(nats_url: str | None = None, *, small: bool = False,
                     **sections: Any) -> ClusterConfig:
    """A mock-runner cluster; ``sections`` are merged in at every depth (so
    ``engine={"mock": {"step_base_s": 0.01}}`` changes that one field). ``nats_url``: an
    external nats-server and a fresh namespace (each test its own streams and consumers).
    ``small``: ``SMALL_ENGINE`` on top of ``MOCK_ENGINE``, and ``NO_MODEL``."""
    data: dict[str, Any] = {
        **REMOTE_WHEN_ALLOWED,
        "model": {"name": MODEL, "path": NO_MODEL} if small else {"name": MODEL},
        "engine": merged(MOCK_ENGINE, SMALL_ENGINE) if small else MOCK_ENGINE,
        "discovery": {"ttl_s": 2.0, "heartbeat_s": 0.5},
    }
    if nats_url is not None:
        data["namespace"] = f"t{uuid.uuid4().hex[:10]}"
        data["nats"] = {"url": nats_url, "embedded": False}
    return parse_config(merged(data, sections))


def cluster_cfg(nats_url: str, **sections: Any) -> ClusterConfig:
    """A config for a runner other than the mock (``sections`` merged over
    ``REMOTE_WHEN_ALLOWED``) on ``nats_url`` in a fresh namespace."""
    return parse_config(merged({"namespace": f"t{uuid.uuid4().hex[:10]}",
                                "nats": {"url": nats_url, "embedded": False},
                                **REMOTE_WHEN_ALLOWED}, sections))
