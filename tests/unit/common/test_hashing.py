import struct

import numpy as np
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from services.common.hashing import (
    HASH_SEED,
    block_hashes,
    chain_hash,
    hash_block,
    local_block_hashes,
    seq_hashes,
)


def _naive(tokens: list[int], bs: int) -> list[tuple[int, int]]:
    out = []
    prev = None
    for i in range(len(tokens) // bs):
        data = b"".join(struct.pack("<I", t) for t in tokens[i * bs : (i + 1) * bs])
        lh = xxhash.xxh3_64_intdigest(data, seed=1337)
        sh = lh if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, lh), seed=1337)
        out.append((sh, lh))
        prev = sh
    return out


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 9))
def test_matches_the_design_formula(tokens: list[int], bs: int) -> None:
    got = [(b.seq_hash, b.local_hash) for b in block_hashes(tokens, bs)]
    assert got == _naive(tokens, bs)
    assert len(got) == len(tokens) // bs


def test_partial_tail_is_not_hashed_and_numpy_input_agrees() -> None:
    toks = list(range(37))
    assert len(local_block_hashes(toks, 16)) == 2
    assert local_block_hashes(np.array(toks, dtype=np.int64), 16) == local_block_hashes(toks, 16)
    assert HASH_SEED == 1337


def test_incremental_hashing_equals_bulk() -> None:
    toks = [5, 9, 2, 7] * 12
    bulk = block_hashes(toks, 8)
    parent = None
    for i, expected in enumerate(bulk):
        b = hash_block(parent, toks[i * 8 : (i + 1) * 8])
        assert b == expected
        parent = b.seq_hash
    # chaining after a parent continues the same chain
    tail = block_hashes(toks[16:], 8, parent_seq_hash=bulk[1].seq_hash)
    assert tail == bulk[2:]
    assert seq_hashes([b.local_hash for b in bulk]) == [b.seq_hash for b in bulk]


def test_same_block_different_prefix_differs_only_in_seq_hash() -> None:
    a = block_hashes([1] * 8 + [3] * 8, 8)
    b = block_hashes([2] * 8 + [3] * 8, 8)
    assert a[1].local_hash == b[1].local_hash
    assert a[1].seq_hash != b[1].seq_hash
    assert chain_hash(None, 42) == 42
