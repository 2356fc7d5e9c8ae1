"""A fake Kubernetes API server for the planner's Kubernetes actuator: the Deployments of
deploy/k8s served at the apps/v1 paths, with their ``scale`` subresource (GET, PATCH), in a
thread. Every PATCH is recorded; ``scale_by_hand`` is `kubectl scale`."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
_PREFIX = "/apis/apps/v1/namespaces/"


class FakeK8s:
    def __init__(self, namespace: str, files: tuple[str, ...] = ("prefill.yaml", "decode.yaml")) -> None:
        self.namespace = namespace
        self.deployments: dict[str, dict] = {}
        for f in files:
            for doc in yaml.safe_load_all((K8S / f).read_text()):
                if doc and doc["kind"] == "Deployment":
                    self.deployments[doc["metadata"]["name"]] = doc
        self.patches: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def replicas(self, name: str) -> int:
        return self.deployments[name]["spec"]["replicas"]

    def scale_by_hand(self, name: str, n: int) -> None:
        with self._lock:
            self.deployments[name]["spec"]["replicas"] = n

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _scale(self, name: str) -> dict:
        d = self.deployments[name]
        labels = d["spec"]["selector"]["matchLabels"]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": self.namespace},
                "spec": {"replicas": d["spec"]["replicas"]},
                "status": {"replicas": d["spec"]["replicas"],
                           "selector": ",".join(f"{k}={v}" for k, v in labels.items())}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _target(self) -> tuple[str, bool] | None:
                """(deployment, is the scale subresource) of a path in our namespace."""
                path = self.path.split("?")[0]
                head = f"{_PREFIX}{fake.namespace}/deployments/"
                if not path.startswith(head):
                    return None
                name, _, sub = path[len(head):].partition("/")
                if name not in fake.deployments or sub not in ("", "scale"):
                    return None
                return name, sub == "scale"

            def _not_found(self) -> None:
                self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "reason": "NotFound", "code": 404})

            def do_GET(self) -> None:
                t = self._target()
                if t is None:
                    return self._not_found()
                with fake._lock:
                    self._reply(200, fake._scale(t[0]) if t[1] else fake.deployments[t[0]])

            def do_PATCH(self) -> None:
                t = self._target()
                if t is None or not t[1]:
                    return self._not_found()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = int(body["spec"]["replicas"])
                with fake._lock:
                    fake.deployments[t[0]]["spec"]["replicas"] = n
                    fake.patches.append((t[0], n))
                    self._reply(200, fake._scale(t[0]))

        return Handler
