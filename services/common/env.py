"""Every environment variable tandem reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where fetched models and other downloads live (``TANDEM_CACHE_DIR``)."""
    return Path(os.environ.get("TANDEM_CACHE_DIR", Path.home() / ".cache" / "tandem"))


# Arguments services/launcher/replica_slot.py adds to the part's command (shell words).
PART_ARGS = "TANDEM_PART_ARGS"

# A part's instance id (discovery key, worker id) when its replica index cannot be unique:
# the pods of one Kubernetes Deployment run one command, so each is given its pod's name.
INSTANCE_ID = "TANDEM_INSTANCE_ID"


def instance_id() -> str | None:
    return os.environ.get(INSTANCE_ID) or None


def in_ci() -> bool:
    """True under CI (``CI=true``): tests that need the real model fail instead of skip."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


# NOTE: secrets come from the environment so they need not sit in a config file that is
# committed or shown by `tandem config`, nor on a command line (which any local user can
# read in ps); a value set in the config file wins over these. Each has a ``_FILE`` twin
# naming a file that holds the value (a compose secret, a mounted k8s Secret), read when
# the variable itself is unset or empty.
NATS_USER = "TANDEM_NATS_USER"
NATS_PASSWORD = "TANDEM_NATS_PASSWORD"
NATS_TOKEN = "TANDEM_NATS_TOKEN"
API_KEYS = "TANDEM_API_KEYS"  # comma-separated; the _FILE twin holds one key per line
FILE_SUFFIX = "_FILE"


def secret(var: str) -> str | None:
    """``$var``, else the content of the file ``$var_FILE`` names (trailing newline
    dropped), else None. An unreadable file is a ValueError naming the variable."""
    value = os.environ.get(var)
    if value:
        return value
    path = os.environ.get(var + FILE_SUFFIX)
    if not path:
        return None
    try:
        return Path(path).read_text().rstrip("\r\n") or None
    except OSError as e:
        raise ValueError(f"{var}{FILE_SUFFIX}={path}: cannot read it: {e.strerror}") from None


CLUSTER_TOKEN = "TANDEM_CLUSTER_TOKEN"
CLUSTER_TOKEN_FILE = CLUSTER_TOKEN + FILE_SUFFIX


def cluster_token() -> str | None:
    """The shared secret every internal gRPC call carries (``TANDEM_CLUSTER_TOKEN`` or its
    ``_FILE`` twin: a mounted Kubernetes or compose secret). None: the internal gRPC ports
    are open (a part run by hand for development); ``tandem up`` always sets one."""
    return secret(CLUSTER_TOKEN)


def nats_credentials() -> dict[str, str]:
    """NATS credentials set in the environment, as NatsConfig field -> value.

    ``TANDEM_NATS_USER`` / ``TANDEM_NATS_PASSWORD`` (user and password) and
    ``TANDEM_NATS_TOKEN`` (token auth), or their ``_FILE`` twins; unset or empty ones are
    left out.
    """
    pairs = (("user", NATS_USER), ("password", NATS_PASSWORD), ("token", NATS_TOKEN))
    found = {field: secret(var) for field, var in pairs}
    return {field: v for field, v in found.items() if v}


def api_keys() -> list[str]:
    """The frontend's API keys from ``TANDEM_API_KEYS`` (comma-separated) or the file
    ``TANDEM_API_KEYS_FILE`` names (one per line); [] when neither is set."""
    value = os.environ.get(API_KEYS)
    if value:
        keys = value.split(",")
    else:
        keys = (secret(API_KEYS) or "").splitlines()
    return [k.strip() for k in keys if k.strip()]


# `tandem planner`: a policy from outside the package, "module:factory" (the factory takes
# the PlannerConfig and returns a Policy): experiments and the tests' fake policies. Unset:
# the built-in policy ``planner.policy`` names.
PLANNER_POLICY = "TANDEM_PLANNER_POLICY"


def planner_policy() -> str | None:
    return os.environ.get(PLANNER_POLICY) or None
