"""The launcher's Prometheus metrics, served on ``launcher.metrics_port`` like every other
part's: restarts are what an operator alerts on, and the launcher alone sees them."""

from __future__ import annotations

from collections.abc import Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class LauncherMetrics:
    def __init__(self, processes: Iterable[str], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # label "part": the process name as `tandem up` prints it (nats, router, decode-0, ...)
        self.restarts = Counter("tandem_launcher_restarts_total",
                                "Restarts of a part of the cluster after it died", ["part"], registry=r)
        self.up = Gauge("tandem_launcher_part_up",
                        "1 while a part is running and ready, else 0", ["part"], registry=r)
        for name in processes:
            # every series exists from the start, so rate() and alerts see the first restart
            self.restarts.labels(name)
            self.up.labels(name).set(0)

    def serve(self, port: int) -> WSGIServer:
        """/metrics on ``port`` (all interfaces, as the parts serve theirs) in a daemon thread."""
        server, _thread = start_http_server(port, registry=self.registry)
        return server
