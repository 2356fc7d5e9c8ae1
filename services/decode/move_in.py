"""Target side of a move (docs/reliability.md "Moving requests on scale-down"): continue a
request that a draining worker holds, importing its KV instead of prefilling it.

The processor sends the request as it would a replay (prompt + the tokens produced,
``max_tokens`` less and ``seed_step_offset`` more by their count) plus ``move_from``.
Here it is parked as a remote prefill of everything but its last token (whose KV the next
step computes): ``max_tokens`` one more, ``seed_step_offset`` one less; the blocks it lacks
are pulled from the source's MoveKv into this worker's KvReceiver under a fresh transfer
token and imported with that last token as the "first token", which is not streamed again
(the client has it). The grammar matcher is replayed over the produced tokens and that
last token advances it, the seeded draw continues at the produced count, and stop,
min_tokens and penalty accounting start from the produced tokens: the state of the replay.

Any failure (no blocks, the source gone or expired, a refused or broken transfer, the
timeout) ends in the replay: the parked request is aborted and the same request is
prefilled here.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace

import grpc

from services.api.move import MoveSource
from services.api.outputs import TokenOutput
from services.common.address_book import ChannelPool
from services.common.grpc_auth import call_metadata
from services.decode.kv_receiver import ExpectedKv, KvReceiver, ReceivedKv
from services.disagg.transfer_token import new_token
from services.engine.async_engine import AsyncEngine
from services.engine.remote_prefill import RemoteKvError, RemotePrefillHandle
from services.engine.request import GenerateRequest
from services.gen import worker_pb2

log = logging.getLogger(__name__)

MOVE_KV_METHOD = "/tandem.worker.DecodeWorker/MoveKv"


class MoveIn(enum.StrEnum):
    """How a moved request continued here (``tandem_worker_moves_received_total{outcome}``)."""

    IMPORTED = "imported"  # its KV pulled and imported: nothing prefilled again
    REPLAYED = "replayed"  # the pull failed: prompt + produced tokens prefilled here


def resumed_request(request: GenerateRequest) -> GenerateRequest:
    """The replay-shaped ``request`` as the remote prefill of all but its last token."""
    sp = request.sampling
    return GenerateRequest(
        request.request_id, request.prompt_token_ids[:-1],
        replace(sp, max_tokens=None if sp.max_tokens is None else sp.max_tokens + 1,
                seed_step_offset=sp.seed_step_offset - 1))


class MoveReceiver:
    """Continues moved requests on one decode worker."""

    def __init__(self, engine: AsyncEngine, receiver: KvReceiver, timeout_s: float,
                 spawn_abort: Callable[[str], None],
                 on_moved_in: Callable[[MoveIn, float], None] | None = None) -> None:
        self._engine = engine
        # Aborts a parked request from a task the worker owns (a cancelled call cannot wait).
        self._spawn_abort = spawn_abort
        self._receiver = receiver
        self._timeout_s = timeout_s
        self._on_moved_in = on_moved_in or (lambda outcome, seconds: None)
        self._channels = ChannelPool()
        self._calls: dict[str, grpc.aio.UnaryStreamMultiCallable] = {}

    async def close(self) -> None:
        await self._channels.close()

    async def generate(self, request: GenerateRequest, source: MoveSource
                       ) -> AsyncIterator[TokenOutput]:
        """The outputs of the moved ``request`` after the tokens it already streamed.
        Closing the iterator early aborts it."""
        rid = request.request_id
        t0 = time.monotonic()
        resumed = resumed_request(request)
        try:
            handle = await self._engine.begin_remote_prefill(resumed)
        except asyncio.CancelledError:
            self._spawn_abort(rid)  # it may be parked by the time the command runs
            raise
        imported = False
        if handle is not None:
            try:
                imported = await self._import(resumed, handle, source, request.prompt_token_ids[-1])
            except BaseException:
                self._receiver.cancel(rid)
                self._spawn_abort(rid)  # cancelled while pulling: free the parked blocks
                raise
            if not imported:
                await self._abort(rid)
        self._on_moved_in(MoveIn.IMPORTED if imported else MoveIn.REPLAYED, time.monotonic() - t0)
        if not imported:
            async with aclosing(self._engine.generate(request)) as outs:
                async for o in outs:
                    yield o
            return
        async with aclosing(self._engine.stream(rid)) as outs:
            first = True
            async for o in outs:
                if first:
                    first = False
                    # NOTE: its first token is the last one the source streamed, appended
                    # again here; tokens behind it in the same output (a reader behind the
                    # engine gets them joined, AsyncEngine.stream) are new.
                    o.token_ids = o.token_ids[1:]
                    o.logprobs = o.logprobs[1:] if o.logprobs and o.token_ids else None
                    if not o.token_ids and not o.finished:
                        continue
                yield o

    async def _import(self, resumed: GenerateRequest, handle: RemotePrefillHandle,
                      source: MoveSource, last_token: int) -> bool:
        rid = resumed.request_id
        got = await self._pull(resumed, handle, source)
        if got is None:
            return False
        try:
            await self._engine.complete_remote_prefill(rid, got.kv, last_token)
        except RemoteKvError as e:  # the engine sent it to local prefill: the replay instead
            log.warning("moved request %s: %s", rid, e)
            return False
        finally:
            got.release()
        return True

    async def _pull(self, resumed: GenerateRequest, handle: RemotePrefillHandle,
                    source: MoveSource) -> ReceivedKv | None:
        """The KV of the parked blocks from ``source``; None (logged) when it cannot be had."""
        rid = resumed.request_id
        spec = self._engine.kv_spec
        token = new_token()
        n = handle.num_blocks_to_fill
        fut = self._receiver.expect(rid, ExpectedKv(handle.first_block_to_fill, n,
                                                     spec.block_range_shape(n), spec.dtype, token))
        req = worker_pb2.MoveKvRequest(
            request_id=rid, move_token=source.token, first_block=handle.first_block_to_fill,
            num_blocks=n, num_tokens=len(resumed.prompt_token_ids), transfer_token=token)
        call = self._call(source.address)(req, timeout=self._timeout_s, metadata=call_metadata())
        try:
            ack = await self._receiver.receive(aiter(call))
            if ack.accepted:
                return fut.result()
            why = ack.error
        except grpc.aio.AioRpcError as e:
            why = f"{e.code().name}: {e.details()}"
        finally:
            call.cancel()
            self._receiver.cancel(rid)
        log.warning("moved request %s: its KV could not be pulled from %s (%s); replaying it",
                    rid, source.worker_id, why)
        return None

    def _call(self, address: str) -> grpc.aio.UnaryStreamMultiCallable:
        call = self._calls.get(address)
        if call is None:
            # NOTE: no deserializer: the KvReceiver takes each KvChunk as its bytes.
            call = self._calls[address] = self._channels.get(address).unary_stream(
                MOVE_KV_METHOD, request_serializer=worker_pb2.MoveKvRequest.SerializeToString)
        return call

    async def _abort(self, rid: str) -> None:
        """Abort the parked (or fallen back) request and wait for its stream's end, so the
        same id can be added again."""
        try:
            await self._engine.abort(rid)
            async with aclosing(self._engine.stream(rid)) as outs:
                async for _ in outs:
                    pass
        except Exception as e:  # the engine died: the caller's generate fails with it
            log.debug("abort of moved %s: %s", rid, e)
