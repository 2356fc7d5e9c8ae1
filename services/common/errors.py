"""The serving errors every part raises, and the one table that maps each to a gRPC status
and to an OpenAI-shaped HTTP error.

A part raises one of these classes; its gRPC servicer aborts with ``abort(context, e)``; the
caller's client turns the status back into the same class with ``from_rpc_error``; the
frontend renders it with ``ERRORS[...]``'s HTTP status and type. ``code``/``param`` (OpenAI's
error ``code`` and ``param``) cross gRPC as trailing metadata. Both directions read
``ERRORS``, so a new error kind is one class and one row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, TypeVar

import grpc

if TYPE_CHECKING:
    from services.api.move import MoveSource

M = TypeVar("M")
T = TypeVar("T")

CODE_KEY = "tandem-error-code"
PARAM_KEY = "tandem-error-param"


class ServingError(Exception):
    """Base of the typed errors; raised as is, it is an internal error (HTTP 500)."""

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param

    @property
    def kind(self) -> str:
        """The label metrics count this error under."""
        return ERRORS[_row_class(type(self))].kind


class InvalidRequest(ServingError):
    """Bad input: empty prompt, bad sampling parameters, prompt longer than the context."""


class GenerationFailed(ServingError):
    """The request failed while generating, for a reason of its own (its grammar refused
    every token): another worker would fail it too, so it is not migrated."""


class ModelNotFound(ServingError):
    """The request names a model this cluster does not serve."""


class Unavailable(ServingError):
    """No router or decode worker can take the request now, or it is shutting down (retry)."""


class Overloaded(Unavailable):
    """The chosen decode worker refused the request: its queue is full (HTTP 429)."""


class RequestMoved(Unavailable):
    """The worker streaming a request is draining and ended the stream: continue it on
    another worker, from ``source`` (its KV waits there) or, None, by replay (nothing was
    kept). An Unavailable, so a caller that knows nothing of moves migrates it by replay.
    Crosses gRPC as a stream's last message (proto/worker.proto GenerateResponse.moved),
    not as a status."""

    def __init__(self, message: str, source: MoveSource | None) -> None:
        super().__init__(message)
        self.source = source


@dataclass(frozen=True, slots=True)
class ErrorKind:
    kind: str  # metrics label
    status: grpc.StatusCode
    http_status: int
    openai_type: str
    default_code: str | None = None
    default_param: str | None = None
    retry_after: bool = False  # the HTTP answer carries Retry-After


ERRORS: dict[type[ServingError], ErrorKind] = {
    InvalidRequest: ErrorKind("invalid_request", grpc.StatusCode.INVALID_ARGUMENT, 400,
                              "invalid_request_error"),
    GenerationFailed: ErrorKind("generation_failed", grpc.StatusCode.FAILED_PRECONDITION, 500,
                                "server_error", "generation_failed"),
    ModelNotFound: ErrorKind("model_not_found", grpc.StatusCode.NOT_FOUND, 404,
                             "invalid_request_error", "model_not_found", "model"),
    Overloaded: ErrorKind("overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, 429,
                          "rate_limit_error", "overloaded", retry_after=True),
    Unavailable: ErrorKind("unavailable", grpc.StatusCode.UNAVAILABLE, 503,
                           "service_unavailable", "no_workers", retry_after=True),
    ServingError: ErrorKind("internal", grpc.StatusCode.INTERNAL, 500, "internal_error"),
}
_BY_STATUS: dict[grpc.StatusCode, type[ServingError]] = {k.status: c for c, k in ERRORS.items()}


def _row_class(cls: type[ServingError]) -> type[ServingError]:
    """The nearest class with a row (a subclass such as the engine's InvalidRequestError
    shares its base's row)."""
    for c in cls.__mro__:
        if c in ERRORS:
            return c  # type: ignore[return-value]
    return ServingError


def kind_of(e: ServingError) -> ErrorKind:
    return ERRORS[_row_class(type(e))]


async def abort(context: grpc.aio.ServicerContext, e: ServingError) -> NoReturn:
    """End a gRPC call with ``e``'s status; code/param travel as trailing metadata."""
    meta = tuple((k, v) for k, v in ((CODE_KEY, e.code), (PARAM_KEY, e.param)) if v)
    await context.abort(kind_of(e).status, e.message, trailing_metadata=meta)
    raise AssertionError("context.abort returned")  # it always raises


async def decode_or_abort(context: grpc.aio.ServicerContext, decode: Callable[[M], T], msg: M) -> T:
    """``decode(msg)``, the check of a message where it enters a process; its ValueError
    ("field: what is wrong") ends the call as an InvalidRequest."""
    try:
        return decode(msg)
    except ValueError as e:
        await abort(context, InvalidRequest(str(e)))


def from_rpc_error(e: grpc.aio.AioRpcError, peer: str, *, name_peer: bool = False) -> ServingError:
    """The typed error a failed call to ``peer`` (e.g. "decode worker 10.0.0.2:9200")
    stands for. A status with no row (a crash, DEADLINE_EXCEEDED, UNKNOWN) is internal and
    its message names the peer and the status; ``name_peer`` names it in an Unavailable's
    message too (a caller that tries several peers says which one refused)."""
    meta = {k: v for k, v in (e.trailing_metadata() or ()) if isinstance(v, str)}
    cls = _BY_STATUS.get(e.code())
    details = e.details() or e.code().name
    code, param = meta.get(CODE_KEY), meta.get(PARAM_KEY)
    if cls is None or cls is ServingError:
        return ServingError(f"{peer} failed: {e.code().name}: {details}", code=code, param=param)
    if name_peer and issubclass(cls, Unavailable):
        details = f"{peer}: {details}"
    return cls(details, code=code, param=param)
