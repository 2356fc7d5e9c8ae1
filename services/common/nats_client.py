"""NATS connection and the one place that names every subject.

Every subject starts with the cluster namespace (docs/architecture.md, "NATS subjects") so
two clusters can share one nats-server without hearing each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import nats
import nats.errors
from nats.aio.client import Client as NatsClient

from services.common.config import NatsConfig
from services.common.env import nats_credentials

log = logging.getLogger(__name__)

__all__ = ["NatsAuthError", "NatsClient", "Subjects", "connect", "with_env_credentials"]


class NatsAuthError(ConnectionError):
    """The nats-server refused our credentials (or we sent none and it wants some)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject names for one namespace. ``*`` forms are for subscriptions."""

    namespace: str

    def kv_events(self, worker_id: str) -> str:
        """A worker publishes encoded KV event batches here (wire.encode_event_batch)."""
        return f"{self.namespace}.kv.events.{worker_id}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.namespace}.kv.events.*"

    def kv_dump(self, worker_id: str) -> str:
        """Request/reply: empty request, reply is wire.encode_dump (the worker's whole cache)."""
        return f"{self.namespace}.kv.dump.{worker_id}"

    def load(self, worker_id: str) -> str:
        """A worker publishes wire.encode_load(WorkerLoad) here a few times a second."""
        return f"{self.namespace}.load.{worker_id}"

    @property
    def load_all(self) -> str:
        return f"{self.namespace}.load.*"

    @property
    def router_inflight(self) -> str:
        """Router replicas share routed/prefilled/freed requests (wire.encode_inflight);
        processors report their requests' first token and end here too."""
        return f"{self.namespace}.router.inflight"

    @property
    def prefill_queue(self) -> str:
        """Decode workers publish prefill_pb2.RemotePrefillRequest here (JetStream)."""
        return f"{self.namespace}.prefill.queue"

    def prefill_progress(self, decode_worker_id: str) -> str:
        """A prefill worker running a job publishes its request id here (the payload, UTF-8)
        when it takes the job and then every ``prefill.in_progress_interval_s``: the decode
        worker that queued it waits as long as these keep coming."""
        return f"{self.namespace}.prefill.progress.{decode_worker_id}"

    @property
    def prefill_cancel(self) -> str:
        """A decode worker that stopped waiting for a job publishes its request id here; the
        prefill worker running it stops and drops it (so no prompt is prefilled twice)."""
        return f"{self.namespace}.prefill.cancel"

    @property
    def prefill_stream(self) -> str:
        """The work-queue JetStream stream holding ``prefill_queue``."""
        return f"{self.namespace}_PREFILL"

    @property
    def prefill_consumer(self) -> str:
        """The one durable pull consumer every prefill worker shares."""
        return f"{self.namespace}_prefill_workers"

    @property
    def discovery_bucket(self) -> str:
        """The JetStream KV bucket holding one key per live instance."""
        return f"{self.namespace}_discovery"


async def connect(cfg: NatsConfig, name: str, no_echo: bool = False) -> NatsClient:
    """Connect with credentials from ``cfg`` and reconnect forever after a disconnect.
    ``no_echo``: the server does not deliver this connection's own publishes back to its
    subscriptions (JetStream deliveries are unaffected).

    The first connect is retried a few times so a part started next to a nats-server that is
    still booting does not fail; a later loss of the server is survived by reconnecting.
    """
    async def on_error(e: Exception) -> None:
        # NOTE: one line per error; nats-py's default logs a traceback every retry.
        log.warning("%s: NATS error: %s: %s", name, type(e).__name__, e)

    async def on_disconnected() -> None:
        log.warning("%s: disconnected from NATS; reconnecting", name)

    async def on_reconnected() -> None:
        log.warning("%s: reconnected to NATS", name)

    opts: dict = {
        "servers": [cfg.url],
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 2,
        "allow_reconnect": True,
        "no_echo": no_echo,
    }
    cfg = with_env_credentials(cfg)
    first = True

    async def on_error(e: Exception) -> None:
        # NOTE: nats-py retries a refused first connect forever; wrong credentials never
        # get better, so end the first connect with the reason instead of hanging.
        if first and _is_auth_error(e):
            raise e
        log.warning("nats %s: %s", name, e)

    opts["error_cb"] = on_error
    if cfg.user is not None:
        opts["user"] = cfg.user
        opts["password"] = cfg.password or ""
    if cfg.token is not None:
        opts["token"] = cfg.token
    try:
        nc = await nats.connect(**opts)
    except nats.errors.Error as e:
        if _is_auth_error(e):
            how = "user/password" if cfg.user else "token" if cfg.token else "no credentials"
            raise NatsAuthError(
                f"nats-server at {cfg.url} refused {name!r} ({how}): {e}; set nats.user/"
                "nats.password or nats.token in the config, or TANDEM_NATS_USER/"
                "TANDEM_NATS_PASSWORD/TANDEM_NATS_TOKEN in the environment") from None
        raise
    first = False
    return nc


def _is_auth_error(e: Exception) -> bool:
    return isinstance(e, nats.errors.AuthorizationError) or "authorization" in str(e).lower()


def with_env_credentials(cfg: NatsConfig) -> NatsConfig:
    """``cfg`` with credentials it leaves unset filled from the environment (services.common.env)."""
    missing = {k: v for k, v in nats_credentials().items() if getattr(cfg, k) is None}
    return cfg.model_copy(update=missing) if missing else cfg
