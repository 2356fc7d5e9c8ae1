"""Stage 3: the decode worker for a prompt, from the router.

The router is shared and processors scale out, so the prompt is hashed here (image blocks
with their images' hashes), not in the router."""

from __future__ import annotations

from services.api.route import RequestPhase, RouteRequest, RouteResponse
from services.common.errors import Unavailable
from services.common.hashing import local_block_hashes
from services.processor.router_reports import RouterLike, RouterReports
from services.processor.stages.prompt import Prompt


class RouteStage:
    def __init__(self, router: RouterLike, reports: RouterReports, block_size: int) -> None:
        self._router = router
        self._reports = reports
        self.block_size = block_size

    async def route(self, request_id: str, prompt: Prompt, produced: list[int] | None = None,
                    exclude: tuple[str, ...] = ()) -> RouteResponse:
        """The worker for ``prompt`` (followed by the ``produced`` tokens of a migrating
        request), none of ``exclude``. Raises InvalidRequest or Unavailable."""
        ids = prompt.ids + produced if produced else prompt.ids
        hashes = local_block_hashes(ids, self.block_size, prompt.images)
        # A prompt under one block has no hashes, so it goes as its (few) token ids.
        req = RouteRequest(request_id, () if hashes else ids, hashes or None, exclude)
        route = await self._router.route(req)
        if not route.address:
            await self._reports.send_now(request_id, RequestPhase.FINISHED)
            raise Unavailable(f"decode worker {route.worker_id} announced no gRPC address")
        return route


def routed_cached_tokens(route: RouteResponse, block_size: int, prompt: Prompt) -> int:
    """The prompt tokens ``route``'s worker held in the router's view: the usage's cached
    count where the worker's own did not come (it was cancelled or replaced)."""
    return min(route.overlap_blocks * block_size, len(prompt.ids))
