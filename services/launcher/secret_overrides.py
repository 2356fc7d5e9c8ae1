"""Secrets given to `tandem up` as ``--set`` overrides travel to the children in their
environment, not on their command lines (which ``ps`` shows every local user).

A secret override is replaced on the child's command line by one that clears the key (so a
value in the config file cannot win over it) and its value goes into the variable the
child reads when the key is unset (services/common/env.py). Only the parts that use a
secret get it: the API keys go to the frontend alone.
"""

from __future__ import annotations

import yaml

from services.common import env

# key -> (the variable that carries it, the assignment that clears it, the parts that get it)
_SECRETS: dict[str, tuple[str, str, tuple[str, ...] | None]] = {
    "frontend.api_keys": (env.API_KEYS, "frontend.api_keys=[]", ("frontend",)),
    "nats.password": (env.NATS_PASSWORD, "nats.password=null", None),  # None: every part
    "nats.token": (env.NATS_TOKEN, "nats.token=null", None),
}


def _env_value(key: str, raw: str) -> str:
    value = yaml.safe_load(raw) if raw.strip() else ""
    if key != "frontend.api_keys":
        return "" if value is None else str(value)
    keys = value if isinstance(value, list) else [value]
    keys = [str(k) for k in keys if k is not None and str(k)]
    if any("," in k for k in keys):
        raise ValueError("--set frontend.api_keys: a key with a comma cannot be passed on; "
                         "use TANDEM_API_KEYS_FILE (one key per line)")
    return ",".join(keys)


def split_overrides(overrides: list[str]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(the overrides children get on their command line, part -> variables to add to its
    environment; the key ``*`` holds those for every part)."""
    public: list[str] = []
    envs: dict[str, dict[str, str]] = {}
    for o in overrides:
        key, _, raw = o.partition("=")
        secret = _SECRETS.get(key.strip())
        if secret is None:
            public.append(o)
            continue
        var, clear, parts = secret
        public.append(clear)
        for part in parts or ("*",):
            envs.setdefault(part, {})[var] = _env_value(key.strip(), raw)
    return public, envs


def env_for(part: str, envs: dict[str, dict[str, str]]) -> dict[str, str]:
    """The variables ``part`` gets from ``split_overrides``' second value."""
    if part == "nats":  # nats-server reads none of them
        return {}
    return {**envs.get("*", {}), **envs.get(part, {})}
