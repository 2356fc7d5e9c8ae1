"""Stop strings with hold-back, checked against a brute-force oracle on the whole text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.processor.stop import StopMatcher


def oracle(text: str, stops: list[str]) -> tuple[str, bool]:
    """The answer on the whole text: cut before the stop occurrence that ends first
    (ties: the one that starts first); no stop: the whole text."""
    best: tuple[int, int] | None = None
    for s in stops:
        for i in range(len(text) - len(s) + 1):
            if text[i:i + len(s)] == s:
                key = (i + len(s), i)
                if best is None or key < best:
                    best = key
    return (text, False) if best is None else (text[: best[1]], True)


def run(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        out.append(m.feed(p))
        if m.stopped:
            break
    if not m.stopped:
        out.append(m.flush())
    return out, m.stopped


alphabet = st.sampled_from("abc🙂")


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet, max_size=4), max_size=8),
    stops=st.lists(st.text(alphabet, min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_matches_oracle_for_any_split(pieces: list[str], stops: list[str]) -> None:
    out, stopped = run(pieces, stops)
    want, want_stopped = oracle("".join(pieces), stops)
    assert "".join(out) == want
    assert stopped == want_stopped


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet, max_size=4), max_size=8),
    stops=st.lists(st.text(alphabet, min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_never_emits_past_the_final_answer(pieces: list[str], stops: list[str]) -> None:
    """At every point, what was emitted is a prefix of the final answer (nothing retracted)."""
    want, _ = oracle("".join(pieces), stops)
    m = StopMatcher(stops)
    emitted = ""
    for p in pieces:
        emitted += m.feed(p)
        assert want.startswith(emitted)


def test_stop_is_reported_as_soon_as_it_completes() -> None:
    m = StopMatcher(["###"])
    assert m.feed("Paris#") == "Paris"
    assert not m.stopped
    assert m.feed("#") == ""
    assert m.feed("# and more") == ""
    assert m.stopped and m.matched == "###"
    assert m.feed("x") == "" and m.flush() == ""


def test_held_text_is_released_when_it_cannot_become_a_stop() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("a ST") == "a "
    assert m.feed("AR") == "STAR"
    assert m.feed("S") == ""
    assert m.flush() == "S"


def test_no_stops_passes_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""


def test_empty_stop_is_rejected() -> None:
    import pytest

    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["a", ""])
