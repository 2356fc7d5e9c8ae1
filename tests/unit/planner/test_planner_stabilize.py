from services.planner.decision import Action, Decision, Split
from services.planner.signals import ClusterSignals
from services.planner.stabilize import Stabilized


class Scripted:
    """A policy that wants the next split of a list each call."""

    def __init__(self, wants: list[Split]) -> None:
        self.wants = iter(wants)

    def decide(self, signals: ClusterSignals, current: Split) -> Decision:
        w = next(self.wants)
        return Decision(signals.t, current, w, Action.HOLD if w == current else Action.REBALANCE, "scripted")


def _run(wants: list[Split], start: Split, window_s: float = 30.0, interval: float = 10.0) -> list[Split]:
    pol = Stabilized(Scripted(wants), window_s, max_total=8)
    cur, out = start, []
    for i in range(len(wants)):
        cur = pol.decide(ClusterSignals(t=interval * i), cur).desired
        out.append(cur)
    return out


def test_scale_up_goes_at_once_and_down_only_after_the_window() -> None:
    got = _run([Split(2, 6)] + [Split(1, 1)] * 5, Split(1, 1))
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


def test_a_zero_window_passes_the_policy_through() -> None:
    got = _run([Split(2, 6), Split(1, 1)], Split(2, 6), window_s=0.0)
    assert got == [Split(2, 6), Split(1, 1)]


def test_decode_never_shrinks_below_the_seats_its_requests_in_flight_need() -> None:
    from services.planner.signals import Role, WorkerSignals

    pol = Stabilized(Scripted([Split(1, 1)]), 0.0, max_total=8, seats=64)
    busy = tuple(WorkerSignals(f"d{i}", Role.DECODE, requests_running=64, requests_waiting=30) for i in range(4))
    d = pol.decide(ClusterSignals(t=0.0, workers=busy), Split(3, 4))
    assert d.desired == Split(1, 4)  # 376 in flight need 6 workers of 64 seats: all 4 stay
