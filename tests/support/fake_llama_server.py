"""A stand-in for llama.cpp's llama-server, for `bench anchor`'s tests: answers /health,
the native /completion with fixed ``timings``, and a streamed /v1/completions of
``max_tokens`` one-character chunks with usage. Reads only ``--port`` of its arguments and
writes them all to ``$FAKE_LLAMA_ARGV`` (a file) so a test can check them.

Run as ``python tests/support/fake_llama_server.py [llama-server args...]``.
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TIMINGS = {"prompt_n": 8, "prompt_ms": 10.0, "prompt_per_second": 321.0,
           "predicted_n": 4, "predicted_ms": 40.0, "predicted_per_second": 61.0}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the stream ends when the connection closes

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json({"status": "ok"})
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/completion":
            self._json({"content": "x" * body["n_predict"], "timings": TIMINGS})
            return
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            chunk = {"choices": [{"text": "x", "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def main() -> None:
    argv = sys.argv[1:]
    if os.environ.get("FAKE_LLAMA_ARGV"):
        with open(os.environ["FAKE_LLAMA_ARGV"], "w") as f:
            json.dump(argv, f)
    port = int(argv[argv.index("--port") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
