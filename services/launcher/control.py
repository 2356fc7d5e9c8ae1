"""The launcher's control endpoint: how the planner's local actuator reaches the supervisor
(docs/planner.md, "The control endpoint").

``GET /split`` answers ``{"prefill": n, "decode": m}``: the replicas running or starting.
``POST /split`` with the same body asks the supervisor for that split and answers the split
now current (202): replicas start in free slots, surplus ones drain (supervisor.py).

Locked two ways: it binds 127.0.0.1 only (the planner is the launcher's child on the same
machine), and every call must carry ``Authorization: Bearer <cluster token>``, the secret
`tandem up` gives its children (cluster_token.py), so another local user cannot scale the
cluster either. A call without it is 401.
"""

from __future__ import annotations

import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from services.planner.decision import Split

PATH = "/split"
HOST = "127.0.0.1"
_MAX_BODY = 1024


class Scalable(Protocol):
    def replicas(self) -> dict[str, int]: ...

    def scale(self, counts: dict[str, int]) -> None: ...


def _current(target: Scalable) -> Split:
    r = target.replicas()
    return Split(prefill=r.get("prefill", 0), decode=r.get("decode", 0))


def serve_control(target: Scalable, port: int, token: str) -> ThreadingHTTPServer:
    """Serve the endpoint on 127.0.0.1:``port`` in a daemon thread; ``shutdown()`` stops it."""
    expected = f"Bearer {token}".encode()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # the launcher prints what the supervisor does; requests add nothing

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _allowed(self) -> bool:
            got = self.headers.get("Authorization", "").encode()
            if hmac.compare_digest(got, expected):
                return True
            self._reply(401, {"error": "the cluster token is required (Authorization: Bearer)"})
            return False

        def do_GET(self) -> None:
            if not self._allowed():
                return
            if self.path != PATH:
                self._reply(404, {"error": f"only {PATH}"})
                return
            self._reply(200, _current(target).to_json())

        def do_POST(self) -> None:
            if not self._allowed():
                return
            if self.path != PATH:
                self._reply(404, {"error": f"only {PATH}"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > _MAX_BODY:
                    self._reply(413, {"error": "body too large"})
                    return
                want = Split.from_json(json.loads(self.rfile.read(length) or b"null"))
                target.scale(want.to_json())
            except ValueError as e:  # json's errors are ValueErrors too
                self._reply(400, {"error": str(e)})
                return
            self._reply(202, _current(target).to_json())

    server = ThreadingHTTPServer((HOST, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="control endpoint", daemon=True).start()
    return server
