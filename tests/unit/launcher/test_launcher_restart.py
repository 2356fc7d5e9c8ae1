"""`tandem up`'s restart policy: backoff, reset after a healthy run, giving up on a part
that keeps failing quickly; and the launcher's own port in the preflight checks."""

import pytest

from services.common.config import ConfigError, parse_config
from services.launcher.plan import check_port_conflicts, launcher_ports, plan
from services.launcher.restart import RestartPolicy, RestartTracker


def test_backoff_doubles_up_to_the_cap() -> None:
    t = RestartTracker(RestartPolicy(backoff_s=0.5, backoff_max_s=4, max_quick_restarts=10))
    decisions = [t.on_death(healthy_s=0) for _ in range(6)]
    assert [d.delay_s for d in decisions] == [0.5, 1, 2, 4, 4, 4]
    assert [d.attempt for d in decisions] == [1, 2, 3, 4, 5, 6]
    assert not any(d.give_up for d in decisions)


def test_gives_up_after_max_quick_restarts_in_a_row() -> None:
    t = RestartTracker(RestartPolicy(max_quick_restarts=3))
    assert [t.on_death(healthy_s=1).give_up for _ in range(4)] == [False, False, False, True]
    assert t.restarts == 3


def test_a_healthy_run_resets_backoff_and_the_quick_failure_count() -> None:
    t = RestartTracker(RestartPolicy(backoff_s=0.5, stable_after_s=60, max_quick_restarts=2))
    t.on_death(0)
    assert t.on_death(59).delay_s == 1  # ready but not long enough: still a quick failure
    d = t.on_death(healthy_s=60)  # up a minute: the part was fine, this is a new incident
    assert (d.give_up, d.delay_s, d.quick_failures, d.attempt) == (False, 0.5, 0, 3)
    assert [t.on_death(0).give_up for _ in range(3)] == [False, False, True]


def test_zero_quick_restarts_still_restarts_a_part_that_had_been_healthy() -> None:
    t = RestartTracker(RestartPolicy(stable_after_s=10, max_quick_restarts=0))
    assert not t.on_death(healthy_s=3600).give_up
    assert t.on_death(healthy_s=0).give_up


def test_policy_from_config_and_its_validation() -> None:
    cfg = parse_config({"launcher": {"restart_backoff_s": 1, "restart_backoff_max_s": 8,
                                     "stable_after_s": 20, "max_quick_restarts": 2}})
    assert RestartPolicy.from_config(cfg.launcher) == RestartPolicy(1, 8, 20, 2)
    with pytest.raises(ConfigError, match="restart_backoff_max_s must be at least"):
        parse_config({"launcher": {"restart_backoff_s": 5, "restart_backoff_max_s": 1}})
    with pytest.raises(ConfigError, match="launcher.restart_tries"):
        parse_config({"launcher": {"restart_tries": 5}})


def test_the_launchers_metrics_port_is_checked_like_the_parts() -> None:
    cfg = parse_config({"launcher": {"metrics_port": 9200}})
    with pytest.raises(ValueError, match=r"port 9200 is planned twice: launcher metrics and router grpc"):
        check_port_conflicts(plan(cfg, None), launcher_ports(cfg))
    off = parse_config({"launcher": {"metrics_port": None}})
    assert launcher_ports(off) == ()
    assert [p.key for p in launcher_ports(parse_config({}))] == ["launcher.metrics_port"]
