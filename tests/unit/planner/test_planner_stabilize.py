from services.planner.decision import Split
from services.planner.signals import ClusterSignals, Role, WorkerSignals
from services.planner.stabilize import ScaleDownWindow


def _run(wants: list[Split], start: Split, window_s: float = 30.0, interval: float = 10.0) -> list[Split]:
    """Each recommendation through the window, the kept split applied."""
    w = ScaleDownWindow(window_s, max_total=8, seats=64)
    cur, out = start, []
    for i, want in enumerate(wants):
        cur = w.limit(interval * i, cur, want)
        out.append(cur)
    return out


def test_scale_up_goes_at_once_and_down_only_after_the_window() -> None:
    got = _run([Split(2, 6)] + [Split(1, 1)] * 5, Split(2, 6))
    assert got[0] == Split(2, 6)  # up at once
    assert got[1:4] == [Split(2, 6)] * 3  # the recommendation of t=0 is still in the window
    assert got[4] == Split(1, 1)  # t=40: every recommendation of the last 30 s asked for 1/1


def test_a_dip_shorter_than_the_window_changes_nothing() -> None:
    got = _run([Split(2, 6), Split(1, 1), Split(2, 6), Split(1, 1), Split(2, 6)], Split(2, 6))
    assert got == [Split(2, 6)] * 5


def test_a_rebalance_moves_within_the_budget_while_the_shrinking_role_waits() -> None:
    got = _run([Split(1, 7)] + [Split(6, 2)] * 5, Split(1, 7))
    assert all(s.total <= 8 for s in got)
    assert got[1] == Split(1, 7)  # decode may not shrink yet, so prefill cannot grow
    assert got[-1] == Split(6, 2)


def test_a_zero_window_passes_the_recommendation_through() -> None:
    assert _run([Split(2, 6), Split(1, 1)], Split(2, 6), window_s=0.0) == [Split(2, 6), Split(1, 1)]


def test_decode_never_shrinks_below_the_seats_its_requests_in_flight_need() -> None:
    busy = tuple(WorkerSignals(f"d{i}", Role.DECODE, requests_running=64, requests_waiting=30) for i in range(4))
    kept = ScaleDownWindow(0.0, max_total=8, seats=64).limit(0.0, Split(3, 4), Split(1, 1),
                                                              ClusterSignals(t=0.0, workers=busy))
    assert kept == Split(1, 4)  # 376 in flight need 6 workers of 64 seats: all 4 stay


def test_the_policies_cooldown_counts_only_changes_made() -> None:
    """A recommendation the window holds back is not a change: the cooldown does not start."""
    from tests.unit.planner.test_planner_formula import cfg, policy, signals

    p = policy(cfg("planner.cooldown_s=30", "planner.scale_down_window_s=1000"))
    busy = p.decide(signals(10.0, 2.0, 4000, 50), Split(1, 1))
    assert busy.desired.total > 2
    held = p.decide(signals(50.0, 0.01, 100, 50), busy.desired)  # the load fell: held by the window
    assert held.desired == busy.desired and held.reason == "stabilizing"
    up = p.decide(signals(60.0, 6.0, 4000, 50), busy.desired)  # a rise right after: not in a cooldown
    assert up.reason != "cooldown" and up.desired.total >= busy.desired.total


def test_a_planner_just_started_shrinks_nothing_before_a_whole_window() -> None:
    got = _run([Split(1, 1)] * 5, Split(4, 4))
    assert got[:4] == [Split(4, 4)] * 4 and got[4] == Split(1, 1)
