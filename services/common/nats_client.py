"""NATS connection, the one place that names every subject, and what each role may do
with them.

Every subject starts with the cluster namespace (docs/architecture.md, "NATS subjects") so
two clusters can share one nats-server without hearing each other. ``role_permissions``
turns the same names into each role's nats-server allow lists (docs/operations.md, "The
internal plane: NATS users and permissions").
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

import nats
import nats.errors
from nats.aio.client import Client as NatsClient

from services.common.config import NatsConfig
from services.common.env import nats_credentials

log = logging.getLogger(__name__)

__all__ = ["ROLES", "NatsAuthError", "NatsClient", "NatsTlsError", "RolePermissions", "Subjects",
           "connect", "flush", "inbox_prefix", "role_permissions", "tls_context", "with_env_credentials"]


class NatsAuthError(ConnectionError):
    """The nats-server refused our credentials (or we sent none and it wants some)."""


class NatsTlsError(ConnectionError):
    """The nats-server's certificate is not signed by a CA we trust (``nats.tls_ca``)."""


class NatsUnreachableError(ConnectionError):
    """No nats-server accepted the first connect within ``nats.startup_wait_s``."""


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

    @property
    def cache_reset(self) -> str:
        """Request with many replies: every decode and prefill worker evicts its cached,
        unreferenced prefix blocks and answers wire.encode_cache_reset (the frontend's
        ``POST /reset_prefix_cache`` counts the answers against discovery)."""
        return f"{self.namespace}.cache.reset"

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

    @property
    def discovery_stream(self) -> str:
        """The stream behind the bucket (JetStream names a KV bucket's stream ``KV_<bucket>``)."""
        return f"KV_{self.discovery_bucket}"

    def discovery_key(self, role: str, instance_id: str) -> str:
        """The subject a put or delete of one discovery key is published on."""
        return f"$KV.{self.discovery_bucket}.{role}.{instance_id}"

    @property
    def discovery_all(self) -> str:
        return f"$KV.{self.discovery_bucket}.>"


# -- who may do what --------------------------------------------------------------------------
# The nats-server users `tandem up` and the deploys create get exactly these permissions
# (docs/operations.md, "The internal plane: NATS users and permissions"). They are derived
# from Subjects so a renamed subject cannot leave a stale permission behind; a part that
# starts using a new subject or JetStream call needs its role's list extended here.

ROLES = ("frontend", "processor", "router", "decode", "prefill", "encode", "planner")

_JS_API = "$JS.API"
_DEFAULT_INBOX = "_INBOX"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def inbox_prefix(user: str | None) -> str:
    """The reply-subject prefix a client connecting as ``user`` uses (``connect`` sets it).

    Replies, JetStream acks and pulled prefill jobs arrive on the client's inbox; with one
    shared ``_INBOX.>`` any user could subscribe to everyone's replies, so each user gets
    its own ``_INBOX.<user>`` and may subscribe to that alone.
    """
    if user and _TOKEN.match(user):
        return f"{_DEFAULT_INBOX}.{user}"
    return _DEFAULT_INBOX


@dataclass(frozen=True, slots=True)
class RolePermissions:
    """A nats-server ``permissions`` block: allow lists (everything else is denied)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May publish to the reply subject of a request it received (kv.dump, cache.reset).
    allow_responses: bool = False


def role_permissions(namespace: str, role: str, user: str | None = None,
                     instances: Sequence[str] = ("*",)) -> RolePermissions:
    """What a client of ``role`` may publish and subscribe to in ``namespace``.

    ``instances``: the instance ids (``decode-0``...) this user serves; subjects and
    discovery keys that carry an instance id are allowed for these alone. The default
    ``*`` is role-wide (one user shared by every replica, as in compose and k8s).
    ``user`` names the inbox (see ``inbox_prefix``); default: the role.

    Discovery is read by subscribing to the bucket's subjects and reading keys with
    request/reply gets, never by creating a JetStream consumer: a client that may create a
    push consumer can have the server deliver stored messages to *any* subject (its
    deliver subject is not checked against the creator's permissions), e.g. a forged
    KV event batch onto ``{ns}.kv.events.decode-1``. So no role may create a consumer on
    the bucket, and only the prefill queue's one durable consumer may be created at all.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    s = Subjects(namespace)
    kv, queue, consumer = s.discovery_stream, s.prefill_stream, s.prefill_consumer
    pub = [
        f"{_JS_API}.STREAM.INFO.{kv}",       # open the bucket; list its keys
        f"{_JS_API}.STREAM.CREATE.{kv}",     # whichever part starts first creates it
        f"{_JS_API}.STREAM.MSG.GET.{kv}",    # read one key
        f"{_JS_API}.DIRECT.GET.{kv}.>",      # read one key (direct get)
        *(s.discovery_key(role, i) for i in instances),  # put/delete its own keys only
    ]
    sub = [s.discovery_all, f"{inbox_prefix(user or role)}.>"]
    responses = False
    # Creating the shared queue: both sides create the stream and durable consumer if
    # missing. nats-py names the create subject by durable (legacy) or by name (newer).
    ensure_queue = [
        f"{_JS_API}.STREAM.INFO.{queue}",
        f"{_JS_API}.STREAM.CREATE.{queue}",
        f"{_JS_API}.CONSUMER.DURABLE.CREATE.{queue}.{consumer}",
        f"{_JS_API}.CONSUMER.CREATE.{queue}.{consumer}",
        f"{_JS_API}.CONSUMER.CREATE.{queue}.{consumer}.>",
        f"{_JS_API}.CONSUMER.INFO.{queue}.{consumer}",
    ]
    if role == "frontend":
        pub.append(s.cache_reset)  # POST /reset_prefix_cache; replies come to its inbox
    elif role == "processor":
        pub.append(s.router_inflight)
    elif role == "router":
        pub += [s.router_inflight, s.kv_dump("*")]
        sub += [s.kv_events_all, s.load_all, s.router_inflight]
    elif role == "decode":
        pub += [*(s.kv_events(i) for i in instances), *(s.load(i) for i in instances),
                s.prefill_queue, *ensure_queue,
                f"{_JS_API}.STREAM.MSG.DELETE.{queue}",  # retract a cancelled job
                s.prefill_cancel]  # ... and stop the prefill worker running it
        sub += [*(s.kv_dump(i) for i in instances),
                *(s.prefill_progress(i) for i in instances), s.cache_reset]
        responses = True
    elif role == "planner":
        # it reads the load samples and the prefill stream's state, never a job (a job
        # carries a prompt and its KV transfer token)
        sub.append(s.load_all)
        pub.append(f"{_JS_API}.STREAM.INFO.{queue}")
    elif role == "prefill":
        pub += [*ensure_queue,
                f"{_JS_API}.CONSUMER.MSG.NEXT.{queue}.{consumer}",  # fetch jobs
                f"$JS.ACK.{queue}.{consumer}.>",  # ack, nak, in-progress, term
                s.prefill_progress("*")]  # to the decode worker a job names
        sub += [s.prefill_cancel, s.cache_reset]
        responses = True  # its answer to a cache reset
    return RolePermissions(tuple(pub), tuple(sub), responses)


async def flush(nc: NatsClient, timeout: float = 10.0) -> None:
    """Return once the server has processed every command this connection issued so far.

    ``nc.flush()`` alone does not promise that: nats-py writes its PING straight to the
    socket, ahead of SUBs and PUBs still queued for its flusher task, so the PONG can come
    back before the server has seen a subscription made just before (a peer's publish then
    finds no subscriber). Writing the queue out first puts the PING behind them.
    """
    # NOTE: ``_flush_pending`` is nats-py's own queue drain (what ``publish`` kicks); there
    # is no public call that waits for it.
    await nc._flush_pending(force_flush=True)
    await nc.flush(timeout=timeout)


async def connect(cfg: NatsConfig, name: str, no_echo: bool = False) -> NatsClient:
    """Connect with credentials from ``cfg`` and reconnect forever after a disconnect.
    ``no_echo``: the server does not deliver this connection's own publishes back to its
    subscriptions (JetStream deliveries are unaffected).

    The first connect is retried for up to ``cfg.startup_wait_s`` (a part started next to a
    nats-server that is still booting does not fail), then NatsUnreachableError; a later
    loss of the server is survived by reconnecting.
    """
    async def on_disconnected() -> None:
        log.warning("%s: disconnected from NATS; reconnecting", name)

    async def on_reconnected() -> None:
        log.warning("%s: reconnected to NATS", name)

    opts: dict = {
        "servers": [cfg.url],
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
        # NOTE: nats-py retries a refused first connect forever; wrong credentials or a
        # server certificate we do not trust never get better, so end the first connect
        # with the reason instead of hanging. One line per error: nats-py's default logs a
        # traceback every retry.
        if first and (_is_auth_error(e) or isinstance(e, ssl.SSLCertVerificationError)):
            raise e
        log.warning("nats %s: %s", name, e)

    opts["error_cb"] = on_error
    if cfg.user is not None:
        opts["user"] = cfg.user
        opts["password"] = cfg.password or ""
        # NOTE: the user's permissions allow replies on its own inbox prefix only.
        opts["inbox_prefix"] = inbox_prefix(cfg.user)
    if cfg.token is not None:
        opts["token"] = cfg.token
    tls = tls_context(cfg)
    if tls is not None:
        opts["tls"] = tls
    wait = asyncio.timeout(cfg.startup_wait_s)
    try:
        async with wait:
            nc = await nats.connect(**opts)
    except TimeoutError:
        if not wait.expired():
            raise
        raise NatsUnreachableError(
            f"{name!r} could not connect to nats-server at {cfg.url} within "
            f"nats.startup_wait_s={cfg.startup_wait_s:g} s; is it running and reachable?") from None
    except nats.errors.Error as e:
        if _is_auth_error(e):
            how = "user/password" if cfg.user else "token" if cfg.token else "no credentials"
            raise NatsAuthError(
                f"nats-server at {cfg.url} refused {name!r} ({how}): {e}; set nats.user/"
                "nats.password or nats.token in the config, or TANDEM_NATS_USER/"
                "TANDEM_NATS_PASSWORD/TANDEM_NATS_TOKEN in the environment") from None
        raise
    except ssl.SSLCertVerificationError as e:
        raise NatsTlsError(
            f"{name!r} does not trust the certificate of nats-server at {cfg.url}: "
            f"{e.verify_message}; set nats.tls_ca to the CA that signed it") from None
    first = False
    return nc


def tls_context(cfg: NatsConfig) -> ssl.SSLContext | None:
    """The client TLS context for ``cfg``: None for a plain ``nats://`` server without
    TLS settings. ``nats.tls_ca`` trusts a private CA (else the system's);
    ``nats.tls_cert``/``nats.tls_key`` present a client certificate (mutual TLS)."""
    if not (cfg.url.startswith("tls://") or cfg.tls_ca or cfg.tls_cert):
        return None
    ctx = ssl.create_default_context(cafile=cfg.tls_ca)
    if cfg.tls_cert:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    return ctx


def _is_auth_error(e: Exception) -> bool:
    return isinstance(e, nats.errors.AuthorizationError) or "authorization" in str(e).lower()


def with_env_credentials(cfg: NatsConfig) -> NatsConfig:
    """``cfg`` with credentials it leaves unset filled from the environment (services.common.env)."""
    missing = {k: v for k, v in nats_credentials().items() if getattr(cfg, k) is None}
    return cfg.model_copy(update=missing) if missing else cfg
