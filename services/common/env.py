"""Every environment variable tandem reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where fetched models and other downloads live (``TANDEM_CACHE_DIR``)."""
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


def in_ci() -> bool:
    """True under CI (``CI=true``): tests that need the real model fail instead of skip."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


CLUSTER_TOKEN = "TANDEM_CLUSTER_TOKEN"
CLUSTER_TOKEN_FILE = "TANDEM_CLUSTER_TOKEN_FILE"


def cluster_token() -> str | None:
    """The shared secret every internal gRPC call carries (``TANDEM_CLUSTER_TOKEN``, or the
    first line of the file ``TANDEM_CLUSTER_TOKEN_FILE`` names: a mounted Kubernetes or
    compose secret). None: the internal gRPC ports are open (a part run by hand for
    development); ``tandem up`` always sets one."""
    token = os.environ.get(CLUSTER_TOKEN)
    path = os.environ.get(CLUSTER_TOKEN_FILE)
    if not token and path:
        token = Path(path).read_text().strip()
    return token or None


# NOTE: secrets come from the environment so they need not sit in a config file that is
# committed or shown by `tandem config`; a value set in the config file wins over these.
NATS_USER = "TANDEM_NATS_USER"
NATS_PASSWORD = "TANDEM_NATS_PASSWORD"
NATS_TOKEN = "TANDEM_NATS_TOKEN"


def nats_credentials() -> dict[str, str]:
    """NATS credentials set in the environment, as NatsConfig field -> value.

    ``TANDEM_NATS_USER`` / ``TANDEM_NATS_PASSWORD`` (user and password) and
    ``TANDEM_NATS_TOKEN`` (token auth); unset or empty variables are left out.
    """
    pairs = (("user", NATS_USER), ("password", NATS_PASSWORD), ("token", NATS_TOKEN))
    return {field: os.environ[var] for field, var in pairs if os.environ.get(var)}
