"""A server interceptor that answers an undecodable request with INVALID_ARGUMENT.

Without it grpc.aio's server fails a request whose bytes do not parse as the method's proto
with UNKNOWN and logs a traceback at ERROR for each one; any client (or a port scanner) could
fill the logs. Every tandem gRPC server installs it (``serve_grpc`` in grpc_server.py does).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc


class RejectMalformed(grpc.aio.ServerInterceptor):
    """Deserialize requests itself; a message that does not parse ends the call with
    INVALID_ARGUMENT naming the method. Handlers see exactly what they saw before."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        h = await continuation(details)
        if h is None or h.request_deserializer is None:
            return h
        parse, method = h.request_deserializer, details.method
        ser = h.response_serializer
        if h.unary_unary is not None:
            inner_uu = h.unary_unary

            async def uu(raw: bytes, ctx: grpc.aio.ServicerContext) -> Any:
                return await inner_uu(await _parse(parse, raw, ctx, method), ctx)

            return grpc.unary_unary_rpc_method_handler(uu, response_serializer=ser)
        if h.unary_stream is not None:
            inner_us = h.unary_stream

            async def us(raw: bytes, ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for out in inner_us(await _parse(parse, raw, ctx, method), ctx):
                    yield out

            return grpc.unary_stream_rpc_method_handler(us, response_serializer=ser)
        if h.stream_unary is not None:
            inner_su = h.stream_unary

            async def su(raws: AsyncIterator[bytes], ctx: grpc.aio.ServicerContext) -> Any:
                return await inner_su(_parse_all(parse, raws, ctx, method), ctx)

            return grpc.stream_unary_rpc_method_handler(su, response_serializer=ser)
        inner_ss = h.stream_stream

        async def ss(raws: AsyncIterator[bytes], ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for out in inner_ss(_parse_all(parse, raws, ctx, method), ctx):
                yield out

        return grpc.stream_stream_rpc_method_handler(ss, response_serializer=ser)


async def _parse(parse: Callable[[bytes], Any], raw: bytes, ctx: grpc.aio.ServicerContext,
                 method: str) -> Any:
    try:
        return parse(raw)
    except Exception as e:  # protobuf's DecodeError, or anything a deserializer raises
        await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method} request: {e}")


async def _parse_all(parse: Callable[[bytes], Any], raws: AsyncIterator[bytes],
                     ctx: grpc.aio.ServicerContext, method: str) -> AsyncIterator[Any]:
    async for raw in raws:
        yield await _parse(parse, raw, ctx, method)
