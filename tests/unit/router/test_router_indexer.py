"""The radix index against a brute-force oracle, plus exact small cases."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.hashing import chain_hash, seq_hashes
from services.router.indexer import RadixIndex, UnknownParentError

WORKERS = ["a", "b", "c"]
ALPHABET = st.integers(0, 3)  # few local hashes so prefixes collide and branch


class Oracle:
    """Per worker: the set of seq_hashes it holds; seq_hash -> path of local hashes."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}
        self.path: dict[int, tuple[int, ...]] = {}

    def stored(self, w: str, parent: int | None, locals_: list[int]) -> None:
        prefix = self.path[parent] if parent is not None else ()
        held = self.held.setdefault(w, set())
        for s, lh in zip(seq_hashes(locals_, parent), locals_, strict=True):
            prefix = prefix + (lh,)
            self.path[s] = prefix
            held.add(s)

    def matches(self, query: list[int]) -> dict[str, int]:
        out = {}
        chain = seq_hashes(query)
        for w, held in self.held.items():
            n = 0
            for s in chain:
                if s not in held:
                    break
                n += 1
            if n:
                out[w] = n
        return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_find_matches_agrees_with_oracle(data: st.DataObject) -> None:
    index, oracle = RadixIndex(), Oracle()
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        op = data.draw(st.sampled_from(["stored", "stored", "stored", "removed", "cleared", "remove_worker"]))
        w = data.draw(st.sampled_from(WORKERS))
        held = sorted(oracle.held.get(w, set()))
        if op == "stored":
            parent = data.draw(st.sampled_from([None, *held])) if held else None
            locals_ = data.draw(st.lists(ALPHABET, min_size=1, max_size=5))
            seqs = seq_hashes(locals_, parent)
            index.apply_stored(w, parent, seqs, locals_)
            oracle.stored(w, parent, locals_)
        elif op == "removed":
            gone = data.draw(st.lists(st.sampled_from(held), max_size=4)) if held else []
            gone.append(12345)  # unknown hashes are ignored
            index.apply_removed(w, gone)
            oracle.held.get(w, set()).difference_update(gone)
        elif op == "cleared":
            index.clear_worker(w)
            oracle.held.get(w, set()).clear()
        else:
            index.remove_worker(w)
            oracle.held.pop(w, None)
        index.check_integrity()
        # Queries: every known path plus a random one.
        queries = [list(p) for p in oracle.path.values()][:20]
        queries.append(data.draw(st.lists(ALPHABET, max_size=6)))
        for q in queries:
            assert index.find_matches(q).scores == oracle.matches(q), q
    assert index.num_blocks() == sum(len(h) for h in oracle.held.values())


def test_shared_prefix_and_branch_exact_scores() -> None:
    index = RadixIndex()
    a = [11, 12, 13, 14]
    b = [11, 12, 99]
    index.apply_stored("w1", None, seq_hashes(a), a)
    index.apply_stored("w2", None, seq_hashes(b), b)
    assert index.find_matches([11, 12, 13, 14, 15]).scores == {"w1": 4, "w2": 2}
    assert index.find_matches([11, 12, 99]).scores == {"w1": 2, "w2": 3}
    assert index.find_matches([12]).scores == {}
    # Removing w1's middle block cuts its contiguous prefix there.
    index.apply_removed("w1", [seq_hashes(a)[2]])
    assert index.find_matches(a).scores == {"w1": 2, "w2": 2}
    index.check_integrity()


def test_early_exit_stops_at_single_worker() -> None:
    index = RadixIndex()
    long = list(range(1, 50))
    index.apply_stored("w1", None, seq_hashes(long), long)
    index.apply_stored("w2", None, seq_hashes(long[:3]), long[:3])
    full = index.find_matches(long).scores
    early = index.find_matches(long, early_exit=True).scores
    assert full == {"w1": 49, "w2": 3}
    assert early == {"w1": 4, "w2": 3}  # lower bound for the lone survivor


def test_stored_after_unknown_parent_raises_and_changes_nothing() -> None:
    index = RadixIndex()
    with pytest.raises(UnknownParentError, match="unknown parent"):
        index.apply_stored("w1", chain_hash(None, 5), [chain_hash(chain_hash(None, 5), 6)], [6])
    assert index.num_blocks() == 0
    with pytest.raises(ValueError, match="seq hashes"):
        index.apply_stored("w1", None, [1, 2], [1])


def test_remove_worker_prunes_and_frees_its_bit() -> None:
    index = RadixIndex()
    seq = [1, 2, 3]
    index.apply_stored("w1", None, seq_hashes(seq), seq)
    index.remove_worker("w1")
    index.check_integrity()
    assert index.workers == [] and index.find_matches(seq).scores == {}
    index.apply_stored("w2", None, seq_hashes(seq), seq)  # reuses the freed bit
    assert index.find_matches(seq).scores == {"w2": 3}
