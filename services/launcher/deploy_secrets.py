"""The compose stack's secrets, made on its first start by the one-shot ``secrets`` service
(deploy/docker-compose.yaml): ``python -m services.launcher.deploy_secrets /secrets``.

Into the ``secrets`` volume, each file readable by the one user that needs it (every part
runs under its role's uid, ``ROLE_UIDS``; the volume is mounted only where a secret is
read):

- ``nats/nats-server.conf``: the server's users, one per role with its random password
  (root, the nats container's user);
- ``<role>/nats_password`` and ``<role>/cluster_token``: what the part logs in to NATS
  with and the internal gRPC plane's shared token (``TANDEM_*_FILE``, services/common/env.py);
- ``frontend/api_keys``: the API's bearer key, one per line;
- ``grafana/admin_password``: Grafana's admin password (``GF_SECURITY_ADMIN_PASSWORD__FILE``).

It also makes each scaled role's directory in the ``replica-slots`` volume
(services/launcher/replica_slot.py). The API key and the Grafana password are printed once,
when they are made; later starts keep the files and print where to read them.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.nats_client import ROLES
from services.launcher.nats_auth import NatsUser, deploy_password, render_conf

# NOTE: docker-compose.yaml's `user:` lines and deploy/k8s use the same numbers.
ROLE_UIDS: dict[str, int] = {role: 10001 + i for i, role in enumerate(ROLES)}
GRAFANA_UID = 472  # the official grafana image's user
ROOT_UID = 0
DONE_MARK = ".made"
SCALED_ROLES = ("router", "decode", "prefill", "encode")


@dataclass(frozen=True)
class DeploySecrets:
    """One stack's secrets."""

    nats_passwords: dict[str, str]  # role -> password
    cluster_token: str
    api_key: str
    grafana_password: str

    @classmethod
    def fresh(cls) -> DeploySecrets:
        return cls({role: deploy_password() for role in ROLES}, secrets.token_urlsafe(32),
                   "sk-tandem-" + secrets.token_urlsafe(24), secrets.token_urlsafe(18))

    def files(self, namespace: str) -> dict[str, tuple[int, str]]:
        """Path under the volume -> (owner uid, content)."""
        users = [NatsUser(role, role, ("*",), p) for role, p in self.nats_passwords.items()]
        out: dict[str, tuple[int, str]] = {
            "nats/nats-server.conf": (ROOT_UID, render_conf(namespace, users)),
            "frontend/api_keys": (ROLE_UIDS["frontend"], self.api_key + "\n"),
            "grafana/admin_password": (GRAFANA_UID, self.grafana_password + "\n"),
        }
        for role, password in self.nats_passwords.items():
            out[f"{role}/nats_password"] = (ROLE_UIDS[role], password + "\n")
            out[f"{role}/cluster_token"] = (ROLE_UIDS[role], self.cluster_token + "\n")
        return out


def _owned_dir(path: Path, uid: int, chown: bool) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    if chown:
        os.chown(path, uid, uid)


def write(root: Path, made: DeploySecrets, namespace: str, chown: bool = True) -> None:
    """Write ``made`` under ``root``: a directory per reader (0700) holding its files
    (0400), owned by that reader when ``chown`` (root only; tests pass False)."""
    for rel, (uid, text) in made.files(namespace).items():
        path = root / rel
        _owned_dir(path.parent, uid, chown)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if chown:
            os.chown(tmp, uid, uid)
        os.replace(tmp, path)
    os.chmod(root, 0o755)  # each reader passes through to its own directory alone
    (root / DONE_MARK).touch()


def make_slot_dirs(slots: Path, chown: bool = True) -> None:
    """A directory per scaled role in the replica-slots volume, writable by that role."""
    for role in SCALED_ROLES:
        _owned_dir(slots / role, ROLE_UIDS[role], chown)


def banner(made: DeploySecrets) -> str:
    return "\n".join([
        "=" * 72,
        "tandem: secrets made for this stack (shown this once; see README.md)",
        f"  API key (Authorization: Bearer ...): {made.api_key}",
        f"  Grafana admin password (user admin): {made.grafana_password}",
        "=" * 72,
    ])


REREAD_HINT = ("tandem: secrets already made; read them with\n"
               "  docker compose -f deploy/docker-compose.yaml exec frontend cat /secrets/frontend/api_keys\n"
               "  docker compose -f deploy/docker-compose.yaml run --rm --entrypoint cat secrets "
               "/secrets/grafana/admin_password")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.launcher.deploy_secrets")
    parser.add_argument("root", type=Path, help="the secrets volume's mount point")
    parser.add_argument("--slots", type=Path, help="the replica-slots volume's mount point")
    parser.add_argument("--namespace", default="tandem")
    args = parser.parse_args(argv)
    chown = os.geteuid() == 0
    if args.slots is not None:
        make_slot_dirs(args.slots, chown)
    if (args.root / DONE_MARK).exists():
        print(REREAD_HINT, flush=True)
        return 0
    made = DeploySecrets.fresh()
    write(args.root, made, args.namespace, chown)
    print(banner(made), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
