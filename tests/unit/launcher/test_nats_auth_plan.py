"""NATS locked by default, without a server: the role permissions against the subjects each
part uses, the users and config `tandem up` writes, and secrets kept off command lines."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.cli import build_parser
from services.common import env
from services.common.config import load_config, parse_config
from services.common.nats_client import ROLES, Subjects, inbox_prefix, role_permissions
from services.launcher.nats_auth import instances_of, lock_nats, render_conf, users_for
from services.launcher.plan import plan
from services.launcher.secret_overrides import split_overrides

NS = "tandem"
S = Subjects(NS)
CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def can_pub(role: str, subject: str, instances: tuple[str, ...] = ("*",)) -> bool:
    return any(matches(a, subject) for a in role_permissions(NS, role, instances=instances).publish)


def can_sub(role: str, subject: str, instances: tuple[str, ...] = ("*",)) -> bool:
    return any(matches(a, subject) for a in role_permissions(NS, role, instances=instances).subscribe)


def test_subject_matching_helper() -> None:
    assert matches("a.*.c", "a.b.c") and not matches("a.*", "a.b.c")
    assert matches("a.>", "a.b.c") and not matches("a.>", "a")
    assert matches("$KV.b.decode.decode-0", "$KV.b.decode.decode-0")


# What each part does on NATS (docs/architecture.md, "NATS subjects", "Discovery", "Prefill
# queue"), as (role or roles, publish?, subject): each must be allowed for those roles and
# no other.
JS = "$JS.API"
USES = [
    ("decode", True, S.kv_events("decode-0")),
    ("decode", True, S.load("decode-0")),
    ("decode", False, S.kv_dump("decode-0")),
    ("decode", True, S.prefill_queue),
    ("decode", True, f"{JS}.STREAM.MSG.DELETE.{S.prefill_stream}"),
    ("decode", True, S.prefill_cancel),
    ("decode", False, S.prefill_progress("decode-0")),
    ("prefill", True, S.prefill_progress("decode-0")),
    ("prefill", False, S.prefill_cancel),
    ("frontend", True, S.cache_reset),  # POST /reset_prefix_cache asks every worker
    (("decode", "prefill"), False, S.cache_reset),
    ("router", True, S.kv_dump("decode-0")),
    ("router", False, S.kv_events_all),
    (("router", "planner"), False, S.load_all),  # the planner reads the load samples too
    ("router", False, S.router_inflight),
    ("prefill", True, f"{JS}.CONSUMER.MSG.NEXT.{S.prefill_stream}.{S.prefill_consumer}"),
    ("prefill", True, f"$JS.ACK.{S.prefill_stream}.{S.prefill_consumer}.1.2.3.4.5.6"),
]


@pytest.mark.parametrize(("role", "publish", "subject"), USES)
def test_each_use_is_allowed_for_its_role_alone(role: str | tuple[str, ...], publish: bool,
                                                subject: str) -> None:
    check = can_pub if publish else can_sub
    roles = (role,) if isinstance(role, str) else role
    for r in roles:
        assert check(r, subject, ("decode-0",) if r == "decode" else ("*",)), (r, subject)
    for other in set(ROLES) - set(roles):
        assert not check(other, subject), (other, subject)


def test_in_flight_updates_come_from_routers_and_processors_only() -> None:
    assert {r for r in ROLES if can_pub(r, S.router_inflight)} == {"router", "processor"}
    assert {r for r in ROLES if can_sub(r, S.router_inflight)} == {"router"}


def test_a_worker_acts_under_its_own_ids_only() -> None:
    mine = ("decode-0", "decode-1")
    for subject in (S.kv_events("decode-1"), S.load("decode-1"), S.discovery_key("decode", "decode-1")):
        assert can_pub("decode", subject, mine)
        assert not can_pub("decode", subject.replace("decode-1", "decode-2"), mine)
    assert can_sub("decode", S.kv_dump("decode-1"), mine)
    assert not can_sub("decode", S.kv_dump("decode-2"), mine)
    assert can_sub("decode", S.prefill_progress("decode-1"), mine)
    assert not can_sub("decode", S.prefill_progress("decode-2"), mine)  # others' progress
    assert role_permissions(NS, "decode", instances=mine).allow_responses  # dump replies
    # the workers answer dumps and cache resets; nobody else answers a request
    assert {r for r in ROLES if role_permissions(NS, r).allow_responses} == {"decode", "prefill"}


def test_discovery_every_role_reads_all_and_writes_its_own_keys() -> None:
    for role in ROLES:
        assert can_sub(role, S.discovery_key("decode", "decode-0"))  # read all (the watch)
        assert can_pub(role, f"{JS}.DIRECT.GET.{S.discovery_stream}.$KV.x.decode.decode-0")
        assert can_pub(role, S.discovery_key(role, f"{role}-3"))
        for other in set(ROLES) - {role}:
            assert not can_pub(role, S.discovery_key(other, f"{other}-0"))


def test_no_role_may_create_a_consumer_but_the_prefill_queue_s_one() -> None:
    # A consumer's deliver subject is any subject (the server does not check it against
    # the creator's permissions): creating one would let a part forge any message.
    for role in ROLES:
        creates = [a for a in role_permissions(NS, role).publish if ".CONSUMER." in a and "CREATE" in a]
        for a in creates:
            assert f".{S.prefill_stream}.{S.prefill_consumer}" in a, (role, a)
        assert not can_pub(role, f"{JS}.CONSUMER.CREATE.{S.discovery_stream}")
        assert not can_pub(role, f"{JS}.CONSUMER.CREATE.{S.prefill_stream}")  # ephemeral
        assert not any(matches(a, "x") or a in (">", "$JS.API.>") for a in role_permissions(NS, role).publish)


def test_only_prefill_workers_pull_and_nobody_reads_the_queue_subject() -> None:
    for role in ROLES:
        assert not can_sub(role, S.prefill_queue)
        assert not can_pub(role, f"{JS}.STREAM.MSG.GET.{S.prefill_stream}")
        assert not can_pub(role, f"{JS}.DIRECT.GET.{S.prefill_stream}.x")
    assert [r for r in ROLES if can_pub(r, f"{JS}.CONSUMER.MSG.NEXT.{S.prefill_stream}.{S.prefill_consumer}")] \
        == ["prefill"]


def test_each_user_has_its_own_inbox() -> None:
    assert inbox_prefix("decode-0") == "_INBOX.decode-0"
    assert inbox_prefix("has.dots") == inbox_prefix(None) == "_INBOX"  # not one token: default
    p = role_permissions(NS, "router", user="router")
    assert "_INBOX.router.>" in p.subscribe and not any(matches(a, "_INBOX.decode-0.x") for a in p.subscribe)


def test_permissions_follow_the_namespace() -> None:
    p = role_permissions("blue", "router")
    assert "blue.kv.events.*" in p.subscribe and "$KV.blue_discovery.>" in p.subscribe
    assert not any("tandem" in a for a in p.publish + p.subscribe)
    with pytest.raises(ValueError, match="unknown role"):
        role_permissions(NS, "launcher")


# -- the launcher's users and config -------------------------------------------------------

def test_users_are_per_process_with_their_worker_ids() -> None:
    cfg = parse_config({"engine": {"runner": "mock"}, "decode": {"replicas": 3, "replicas_per_process": 2},
                        "prefill": {"replicas": 2}})
    users = {u.name: u for u in users_for(plan(cfg, None))}
    assert set(users) == {"router", "decode-0-1", "decode-2-2", "prefill-0", "prefill-1", "processor",
                          "frontend"}
    assert users["decode-0-1"].instances == ("decode-0", "decode-1")
    assert users["decode-2-2"].instances == ("decode-2",)
    assert users["router"].instances == ("router-0",) and users["prefill-1"].instances == ("prefill-1",)
    assert len({u.password for u in users.values()}) == len(users) and all(
        len(u.password) >= 32 for u in users.values())
    spec = next(s for s in plan(cfg, None) if s.name == "decode-2-2")
    assert instances_of(spec) == ("decode-2",)


def test_rendered_config_has_every_user_and_no_anonymous_one() -> None:
    cfg = parse_config({})
    users = users_for(plan(cfg, None))
    text = render_conf(NS, users)
    assert not any("no_auth_user" in line for line in text.splitlines() if not line.startswith("#"))
    for u in users:
        assert f'{{user: "{u.name}", password: "{u.password}"' in text
    assert text.count("allow_responses: true") == 2  # decode-0 and prefill-0 alone


def test_lock_nats_writes_a_private_config_and_gives_each_child_its_user(tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / "disagg.yaml", ["nats.password=from-the-file"])
    specs = lock_nats(cfg, plan(cfg, CONFIGS / "disagg.yaml", nats_data_dir=tmp_path / "nats"), tmp_path)
    conf = tmp_path / "nats-server.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    nats = specs[0]
    assert nats.argv[-2:] == ("-c", str(conf))
    text = conf.read_text()
    parser = build_parser()
    for s in specs[1:]:
        user, password = s.env[env.NATS_USER], s.env[env.NATS_PASSWORD]
        assert user == s.name and f'password: "{password}"' in text
        assert s.env[env.NATS_TOKEN] == "" and s.env[env.NATS_TOKEN + env.FILE_SUFFIX] == ""
        assert not any(password in a for a in s.argv)
        # the config's own password is cleared so the generated one (env) is used
        assert "nats.password=null" in parser.parse_args(list(s.argv[3:])).overrides
    assert not any(env.NATS_PASSWORD in k for k in nats.env)


def test_lock_nats_leaves_an_external_server_alone(tmp_path: Path) -> None:
    cfg = parse_config({"nats": {"url": "nats://10.0.0.1:4222", "embedded": False}})
    specs = plan(cfg, None)
    assert lock_nats(cfg, specs, tmp_path) == specs
    assert not (tmp_path / "nats-server.conf").exists()


def test_embedded_nats_refuses_a_tls_url() -> None:
    with pytest.raises(ValueError, match="embedded nats-server has no certificate"):
        plan(parse_config({"nats": {"url": "tls://127.0.0.1:4222"}}), None)


# -- secrets off the command line --------------------------------------------------------------

def test_secret_overrides_go_by_env_to_the_parts_that_use_them() -> None:
    overrides = ["frontend.api_keys=[k-one, k-two]", "nats.token=tok-1", "router.mode=random"]
    cfg = load_config(CONFIGS / "local.yaml", overrides)
    specs = plan(cfg, CONFIGS / "local.yaml", overrides)
    parser = build_parser()
    for s in specs[1:]:
        assert not any("k-one" in a or "tok-1" in a for a in s.argv), s.argv
        args = parser.parse_args(list(s.argv[3:]))
        assert args.overrides == ["frontend.api_keys=[]", "nats.token=null", "router.mode=random"]
        assert s.env[env.NATS_TOKEN] == "tok-1"
        assert (s.env.get(env.API_KEYS) == "k-one,k-two") == (s.part == "frontend")
    assert not any("tok-1" in v for v in specs[0].env.values())  # nats-server needs none


def test_split_overrides_refuses_a_key_it_cannot_pass_on() -> None:
    with pytest.raises(ValueError, match="comma"):
        split_overrides(["frontend.api_keys=['a,b']"])
    assert split_overrides(["frontend.api_keys=single"])[1] == {"frontend": {env.API_KEYS: "single"}}


def test_api_keys_and_credentials_from_env_or_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (env.API_KEYS, env.NATS_USER, env.NATS_PASSWORD, env.NATS_TOKEN):
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var + env.FILE_SUFFIX, raising=False)
    assert load_config(None).frontend.api_keys == []
    keys = tmp_path / "keys"
    keys.write_text("k1\n\n k2 \n")
    monkeypatch.setenv("TANDEM_API_KEYS_FILE", str(keys))
    assert load_config(None).frontend.api_keys == ["k1", "k2"]
    monkeypatch.setenv("TANDEM_API_KEYS", "a, b")
    assert load_config(None).frontend.api_keys == ["a", "b"]
    assert load_config(None, ["frontend.api_keys=[c]"]).frontend.api_keys == ["c"]  # config wins
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    monkeypatch.setenv("TANDEM_NATS_USER", "router")
    monkeypatch.setenv("TANDEM_NATS_PASSWORD_FILE", str(pw))
    assert env.nats_credentials() == {"user": "router", "password": "s3cret"}
    monkeypatch.setenv("TANDEM_NATS_PASSWORD", "direct")  # the variable wins over its file
    assert env.nats_credentials()["password"] == "direct"
    monkeypatch.setenv("TANDEM_NATS_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="TANDEM_NATS_TOKEN_FILE=.*missing: cannot read it"):
        env.nats_credentials()


def test_deploy_passwords_stay_strings_in_the_nats_config() -> None:
    """The deploy config names each password as $VAR and nats-server parses the value:
    one starting with a digit or a dash would be read as a number and refused."""
    from services.launcher.nats_auth import deploy_password

    pws = [deploy_password() for _ in range(200)]
    assert all(p[0].isalpha() and len(p) >= 32 for p in pws) and len(set(pws)) == 200


def test_replicas_the_planner_may_start_get_their_users_too(tmp_path: Path) -> None:
    from services.launcher.plan import reserve

    cfg = load_config(CONFIGS / "local.yaml", ["planner.enabled=true", "planner.max_decode=2"])
    specs = plan(cfg, None)
    spare = reserve(cfg, None)
    locked = lock_nats(cfg, specs + spare, tmp_path)
    by_name = {s.name: s for s in locked}
    assert by_name["decode-1"].env["TANDEM_NATS_USER"] == "decode-1"
    assert by_name["planner"].env["TANDEM_NATS_USER"] == "planner"
    conf = (tmp_path / "nats-server.conf").read_text()
    assert '{user: "decode-1"' in conf and '{user: "planner"' in conf
