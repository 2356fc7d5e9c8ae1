"""uvicorn's HTTP/1.1 protocol (httptools) with a deadline and a size limit on a request's
headers.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) but waits for request
headers forever, and httptools takes headers of any size: a client that connects and sends
nothing, or one header byte a minute, or megabytes of header lines, holds a connection and
its memory for good. Here a request's headers must be complete within ``timeout_s`` of the
connection opening or of the request's first byte (else 408), and within MAX_HEADER_BYTES
(else 431); either way the connection is then closed.

A body is the app's to time (``body.read_json``: it knows which requests read one), except
the part nobody reads: once a response is complete, every byte of its request's unread
body cancels uvicorn's keep-alive timer, which is not armed again when that body ends, so
a GET whose body trickles in after the answer would hold the connection forever. Here the
rest of such a body, and the quiet after it, get ``keep_alive_s``.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Request line and headers together. Ours are a few hundred bytes; 64 KiB leaves room for
# long bearer tokens and cookies a gateway adds (nginx's default allows ~32 KiB).
MAX_HEADER_BYTES = 64 * 1024


def _refusal(status: bytes, message: str, code: str | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}, separators=(",", ":")).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


_TOO_SLOW = _refusal(b"408 Request Timeout", "the request headers did not arrive in time",
                    "request_timeout")
_TOO_LARGE = _refusal(b"431 Request Header Fields Too Large",
                      f"the request headers are larger than {MAX_HEADER_BYTES} bytes",
                      "request_too_large")


def with_header_limits(timeout_s: float, keep_alive_s: float) -> type[asyncio.Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``."""

    class HeaderLimitsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None  # set while headers are being read
        _header_bytes = 0
        _idle_timer: asyncio.TimerHandle | None = None  # set after an answered, unread body

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None:  # still inside a request's headers
                # NOTE: counts the whole chunk (it may end a previous body): an overcount
                # of at most one read, and memory stays bounded either way.
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    self._refuse(_TOO_LARGE)

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to bytes that are not HTTP, in the API's shape (not plain text)
            self._refuse(_refusal(b"400 Bad Request", msg))

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._quiet()
            if self._header_timer is None:  # the next request on a keep-alive connection
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            if self.cycle is not None and self.cycle.response_complete:
                self._idle()  # an unread body ended: from now on the connection is idle

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is not None and self.cycle.more_body:
                self._idle()  # answered before its body arrived: bound the rest of it

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._quiet()
            super().connection_lost(exc)

        def _idle(self) -> None:
            self._quiet()
            if not self.transport.is_closing():
                self._idle_timer = self.loop.call_later(keep_alive_s, self.transport.close)

        def _quiet(self) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

        def _arm(self) -> None:
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(timeout_s, self._refuse, _TOO_SLOW)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _refuse(self, response: bytes) -> None:
            self._disarm()
            if self.transport.is_closing():
                return
            # A response still being sent (to an earlier, pipelined request) must not get
            # ours in its middle: then the connection is only closed.
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(response)
            self.transport.close()

    return HeaderLimitsProtocol
