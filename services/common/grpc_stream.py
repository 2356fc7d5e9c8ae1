"""How a client lets go of a server-streaming call."""

from __future__ import annotations

import asyncio

import grpc

# A finished call's trailing status follows its last message at once; past this the server
# is stuck, and the call is cancelled rather than held.
STATUS_WAIT_S = 2.0


async def close_stream(call: grpc.aio.UnaryStreamCall, ended: bool) -> None:
    """Cancel a call still producing (the server aborts the request). One whose last
    message arrived (``ended``) gets its status awaited instead: a cancel racing the
    trailing status makes the server log an ExecuteBatchError for a request that went fine."""
    try:
        if ended:
            async with asyncio.timeout(STATUS_WAIT_S):
                await call.code()
    except TimeoutError:
        pass
    finally:
        call.cancel()  # a no-op once the call is done
