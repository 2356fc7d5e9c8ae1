"""The compose stack's one-shot secrets service: what it writes, who may read it, and that
a second start keeps the secrets and prints none of them."""

import stat
import subprocess
import sys
from pathlib import Path

from services.common.nats_client import ROLES
from services.launcher.deploy_secrets import (
    DONE_MARK,
    GRAFANA_UID,
    ROLE_UIDS,
    SCALED_ROLES,
    DeploySecrets,
    main,
    make_slot_dirs,
    write,
)

ROOT = Path(__file__).resolve().parents[3]


def test_every_role_gets_its_own_uid_password_and_the_one_cluster_token() -> None:
    made = DeploySecrets.fresh()
    files = made.files("tandem")
    assert len(set(ROLE_UIDS.values())) == len(ROLES) and GRAFANA_UID not in ROLE_UIDS.values()
    for role in ROLES:
        uid, password = files[f"{role}/nats_password"]
        assert uid == ROLE_UIDS[role] and password == made.nats_passwords[role] + "\n"
        assert files[f"{role}/cluster_token"] == (ROLE_UIDS[role], made.cluster_token + "\n")
    assert len(set(made.nats_passwords.values())) == len(ROLES)
    assert files["frontend/api_keys"] == (ROLE_UIDS["frontend"], made.api_key + "\n")
    assert files["grafana/admin_password"] == (GRAFANA_UID, made.grafana_password + "\n")
    # every file lies in its reader's directory: no reader's directory holds another's file
    for rel, (uid, _) in files.items():
        owners = {u for r, (u, _) in files.items() if r.split("/")[0] == rel.split("/")[0]}
        assert owners == {uid}, rel


def test_the_nats_config_holds_every_role_with_its_password() -> None:
    made = DeploySecrets.fresh()
    conf = made.files("tandem")["nats/nats-server.conf"][1]
    for role, password in made.nats_passwords.items():
        assert f'{{user: "{role}", password: "{password}"' in conf
    assert "$TANDEM_NATS_PASSWORD" not in conf


def test_the_nats_config_is_valid_for_nats_server(tmp_path: Path) -> None:
    from services.launcher.nats import NatsServerNotFoundError, find_nats_server
    try:
        binary = find_nats_server()
    except NatsServerNotFoundError:
        import pytest
        pytest.skip("nats-server is not installed")
    conf = tmp_path / "nats.conf"
    conf.write_text(DeploySecrets.fresh().files("tandem")["nats/nats-server.conf"][1])
    out = subprocess.run([binary, "-c", str(conf), "-t"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_files_are_private_to_their_directory(tmp_path: Path) -> None:
    write(tmp_path, DeploySecrets.fresh(), "tandem", chown=False)
    for rel in DeploySecrets.fresh().files("tandem"):
        path = tmp_path / rel
        assert stat.S_IMODE(path.stat().st_mode) == 0o400, rel
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700, rel
    assert (tmp_path / DONE_MARK).exists()


def test_slot_directories_for_each_scaled_role(tmp_path: Path) -> None:
    make_slot_dirs(tmp_path, chown=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(SCALED_ROLES)


def test_the_first_start_prints_the_key_and_password_once(tmp_path: Path, capsys) -> None:
    secrets_dir, slots = tmp_path / "secrets", tmp_path / "slots"
    secrets_dir.mkdir()
    slots.mkdir()
    assert main([str(secrets_dir), "--slots", str(slots)]) == 0
    first = capsys.readouterr().out
    key = (secrets_dir / "frontend" / "api_keys").read_text().strip()
    password = (secrets_dir / "grafana" / "admin_password").read_text().strip()
    assert key in first and password in first
    assert main([str(secrets_dir), "--slots", str(slots)]) == 0
    second = capsys.readouterr().out
    assert key not in second and password not in second and "already made" in second
    assert (secrets_dir / "frontend" / "api_keys").read_text().strip() == key


def test_runs_as_a_module(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "services.launcher.deploy_secrets", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "API key" in out.stdout
