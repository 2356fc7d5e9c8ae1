from services.planner.decision import Split
from services.planner.signals import ClusterSignals, Role, WorkerSignals
from services.planner.stabilize import ScaleDownWindow


def _run(wants: list[Split], start: Split, window_s: float = 30.0, interval: float = 10.0,
         max_total: int = 8, shift_now: bool = True) -> list[Split]:
    """Each recommendation through the window, the kept split applied."""
    w = ScaleDownWindow(window_s, max_total=max_total, seats=64)
    cur, out = start, []
    for i, want in enumerate(wants):
        cur = w.limit(interval * i, cur, want, shift_now=shift_now)
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


def test_a_shift_between_roles_goes_at_once() -> None:
    """The role that shrinks funds the other's growth: holding it a window held the growing
    role too, a whole window behind each change of the load's shape (the old policy here:
    1/7 for three more intervals)."""
    got = _run([Split(1, 7)] + [Split(6, 2)] * 3, Split(1, 7))
    assert got == [Split(1, 7)] + [Split(6, 2)] * 3


def test_a_shift_only_a_tie_break_chose_waits_out_the_window() -> None:
    """With real processes the forward run often predicted every split the same, and its
    tie-breaks swung whole roles (4P/4D -> 2P/6D -> 6P/2D -> 7P/1D within three minutes):
    such a shift holds the shrinking role as a release, so it goes only once the window's
    recommendations all allow it."""
    got = _run([Split(2, 6)] * 6, Split(4, 4), window_s=30.0, shift_now=False)
    assert got == [Split(4, 4)] * 4 + [Split(2, 6)] * 2  # 4P/4D recommended at t=0 counts to t=30
    # the same recommendations with a predicted gain go at once
    assert _run([Split(2, 6)] * 2, Split(4, 4), window_s=30.0) == [Split(2, 6)] * 2


def test_a_shift_the_forecast_asks_for_in_two_steps_goes_on() -> None:
    """The forecast follows a step in two or three intervals, so a move comes in steps; the
    old window took the first step's prefill as a recommendation and held the second a
    whole window (13p3d -> 8p8d, then 8p8d while decode workers preempted)."""
    got = _run([Split(13, 3), Split(9, 7), Split(5, 11)], Split(13, 3), window_s=60.0,
               max_total=16)
    assert got == [Split(13, 3), Split(9, 7), Split(5, 11)]


def test_a_role_that_just_grew_funds_a_shift_the_load_asks_for() -> None:
    """A phase change soon after a move: the role that just grew gives its workers back at
    once when a gain is predicted (a rule that held it a window lost goodput at every phase
    change that came within a window of a move: tandem sim planner-eval's grid); a tie-break
    alone still waits out the window."""
    got = _run([Split(1, 7)] + [Split(6, 2)] * 5, Split(1, 6))
    assert got[0] == Split(1, 7)  # up at once
    assert got[1:] == [Split(6, 2)] * 5  # decode grew at t=0 and funds prefill at t=10
    held = _run([Split(1, 7)] + [Split(6, 2)] * 5, Split(1, 6), shift_now=False)
    assert held[1:4] == [Split(1, 7)] * 3  # 1P/7D recommended at t=0 counts to t=30
    assert held[4] == Split(6, 2)


def test_a_shift_releases_the_workers_beyond_it_only_after_the_window() -> None:
    got = _run([Split(1, 5)] * 5, Split(4, 4))
    assert got[0] == Split(3, 5)  # decode grows at once; the budget in use stays 8
    assert got[1:4] == [Split(3, 5)] * 3
    assert got[4] == Split(1, 5)  # t=40: every recommendation of the last 30 s asked for 6


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


def test_a_planner_just_started_releases_nothing_before_a_whole_window() -> None:
    got = _run([Split(1, 1)] * 5, Split(4, 4))
    assert got[:4] == [Split(4, 4)] * 4 and got[4] == Split(1, 1)


def test_the_formula_moves_decode_workers_to_prefill_when_prompts_grow_at_the_budget() -> None:
    """A decode-heavy load, then a prefill-heavy one, all 16 workers in use: the first
    decision that asks for prefill workers takes them from decode at once. The old window
    held decode at its recommendations of the last minute, so prefill could not grow past
    what the budget left (8P/8D, stabilizing, for six intervals)."""
    from tests.unit.planner.test_planner_formula import cfg, policy, signals

    p = policy(cfg("planner.cooldown_s=30", "planner.scale_down_window_s=60"))
    split = Split(8, 8)
    for i in range(10):
        split = p.decide(signals(10.0 * (i + 1), 5.0, 360, 1500), split).desired
    assert split.decode == 8
    d = p.decide(signals(110.0, 8.0, 700, 40), split)
    assert d.desired.prefill > 8 and d.desired.decode < 8 and d.desired.total <= 16
    assert "stabilizing" not in d.reason
