"""What ``Router.route`` accepts as the prompt: token ids (hashed by the router) or the local
block hashes a caller computed (checked: u64 ints, a bounded count, consistent with token ids
when both are given). Either names the same blocks, so either routes alike."""

from __future__ import annotations

import pytest

from services.api.route import RequestPhase, RouteRequest
from services.common.config import parse_config
from services.common.discovery import Registration
from services.common.hashing import block_hashes, local_block_hashes
from services.router.errors import InvalidRouteRequest
from services.router.router import MAX_ROUTE_BLOCKS, Router

BS = 16


def _router() -> Router:
    router = Router(parse_config({"engine": {"block_size": BS}}), seed=0)
    for w in ("w0", "w1", "w2"):
        router.worker_joined(Registration("decode", w, address=f"{w}:1"))
    return router


def _cache(router: Router, worker: str, tokens: list[int]) -> None:
    blocks = block_hashes(tokens, BS)
    router.index.apply_stored(worker, None, [b.seq_hash for b in blocks], [b.local_hash for b in blocks])


async def test_hashes_and_token_ids_route_alike() -> None:
    router = _router()
    prompt = list(range(1000, 1000 + 10 * BS + 5))  # 10 full blocks and a partial one
    _cache(router, "w2", prompt[: 6 * BS])
    hashes = local_block_hashes(prompt, BS)
    for rid, req in (("a", RouteRequest("a", prompt)), ("b", RouteRequest("b", (), hashes)),
                     ("c", RouteRequest("c", prompt, hashes))):
        r = await router.route(req)
        assert (r.worker_id, r.overlap_blocks, r.request_blocks) == ("w2", 6, 10), rid
        # the same in-flight load: 10 prompt blocks, 4 to prefill
        v = router.load.view("w2")
        assert (v.pending_prefill_blocks, v.active_blocks) == (4, 10), rid
        await router.update(rid, RequestPhase.FINISHED)  # an idle cluster for the next one


@pytest.mark.parametrize(("hashes", "match"), [
    ([1, -1], "u64"),
    ([1, 1 << 64], "u64"),
    ([1, 2.5], "u64"),
    ([1, "2"], "u64"),
    ([1, None], "u64"),
])
async def test_bad_hashes_are_invalid(hashes: list, match: str) -> None:
    with pytest.raises(InvalidRouteRequest, match=match):
        await _router().route(RouteRequest("x", (), hashes))


async def test_hash_counts_are_checked() -> None:
    router = _router()
    prompt = list(range(3 * BS))
    with pytest.raises(InvalidRouteRequest, match="expected one per full block of 16 tokens"):
        await router.route(RouteRequest("x", prompt, local_block_hashes(prompt, 8)))  # wrong block size
    with pytest.raises(InvalidRouteRequest, match=f"more than {MAX_ROUTE_BLOCKS} blocks"):
        await router.route(RouteRequest("x", (), range(MAX_ROUTE_BLOCKS + 1)))
    with pytest.raises(InvalidRouteRequest, match="neither"):
        await router.route(RouteRequest("x", (), None))
    with pytest.raises(InvalidRouteRequest, match="u32"):
        await router.route(RouteRequest("x", [1, -5]))
    assert router.load.inflight_count("w0") + router.load.inflight_count("w1") == 0
    # a prompt under one block routes by its token ids (it has no hashes)
    r = await router.route(RouteRequest("short", [1, 2, 3]))
    assert (r.request_blocks, r.overlap_blocks) == (0, 0)
