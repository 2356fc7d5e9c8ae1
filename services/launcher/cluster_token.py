"""The internal gRPC plane's shared token for a `tandem up` cluster: generated per run (or
taken from the launcher's own ``TANDEM_CLUSTER_TOKEN``, so parts started by hand can join)
and given to every tandem process by environment, never on a command line."""

from __future__ import annotations

import os
import secrets
from dataclasses import replace

from services.common import env
from services.launcher.plan import ProcessSpec


def with_cluster_token(specs: list[ProcessSpec]) -> list[ProcessSpec]:
    token = os.environ.get(env.CLUSTER_TOKEN) or secrets.token_urlsafe(32)
    # NOTE: an inherited token file would be read instead of an empty variable: clear it.
    extra = {env.CLUSTER_TOKEN: token, env.CLUSTER_TOKEN_FILE: ""}
    return [s if s.part == "nats" else replace(s, env={**s.env, **extra}) for s in specs]
