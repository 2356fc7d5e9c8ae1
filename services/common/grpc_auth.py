"""The internal plane's gRPC credential: one shared cluster token (services/common/env.py
``cluster_token``) that every call between parts carries as metadata and every part's
server checks before anything else runs.

A caller passes ``call_metadata()`` to each call; ``serve_grpc`` installs ``RequireToken``
when a token is set. A call without the token ends UNAUTHENTICATED, and its request bytes
are never parsed.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.common.env import cluster_token

TOKEN_KEY = "tandem-cluster-token"
_REFUSED = "this call carries no valid cluster token (see docs/operations.md, \"The internal plane\")"


@functools.cache
def call_metadata() -> tuple[tuple[str, str], ...] | None:
    """What each internal call sends: the token pair, or None when the cluster has none.
    Read once: a part's token does not change while it runs."""
    token = cluster_token()
    return ((TOKEN_KEY, token),) if token else None


class RequireToken(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_KEY:
                got = value if isinstance(value, bytes) else value.encode()
                if hmac.compare_digest(got, self._token):
                    return await continuation(details)
                break
        h = await continuation(details)
        return None if h is None else _refusal(h)


def _refusal(h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``h``'s kind that ends the call UNAUTHENTICATED without reading it."""
    ser = h.response_serializer

    async def deny(_request: Any, ctx: grpc.aio.ServicerContext) -> Any:
        await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

    async def deny_stream(_request: Any, ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
        yield  # never reached: abort raises

    if h.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(deny, response_serializer=ser)
    if h.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, response_serializer=ser)
    if h.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny, response_serializer=ser)
    return grpc.stream_stream_rpc_method_handler(deny_stream, response_serializer=ser)
