"""The embedding block allocator and buffers (seed 002): contiguous runs, exhaustion, free."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.engine.multimodal.blocks import (
    BlockAllocation,
    BlocksExhaustedError,
    EmbeddingBlockAllocator,
)
from services.engine.multimodal.buffers import EmbeddingBuffers
from services.engine.multimodal.metrics import MmBlocksCollector


def test_alloc_default_and_alloc_by_length_are_contiguous_runs():
    a = EmbeddingBlockAllocator(num_blocks=64, block_size=128, default_blocks=8)
    lang = a.alloc_default("r1")
    assert lang == BlockAllocation(start_block=0, num_blocks=8, num_tokens=1024)
    enc = a.alloc(2000, "r2")
    assert enc == BlockAllocation(start_block=8, num_blocks=16, num_tokens=2000)
    rest = a.alloc(976, "r1")
    assert rest == BlockAllocation(start_block=24, num_blocks=8, num_tokens=976)
    assert a.alloc(1, "r3") == BlockAllocation(32, 1, 1)
    assert a.used_blocks == 33


def test_free_returns_blocks_and_first_fit_reuses_the_hole():
    a = EmbeddingBlockAllocator(num_blocks=10, block_size=4, default_blocks=3)
    x, y, z = a.alloc(12, "x"), a.alloc(8, "y"), a.alloc(16, "z")  # 3 + 2 + 4 blocks
    a.free(y, "y")
    assert a.used_blocks == 7
    # 3 blocks do not fit the 2-block hole: they come from the tail.
    with pytest.raises(BlocksExhaustedError):
        a.alloc(12, "w")
    assert a.alloc(5, "v") == BlockAllocation(3, 2, 5)
    a.free(x, "x")
    assert a.alloc_default("u") == BlockAllocation(0, 3, 12)
    a.free(z, "z")
    assert a.used_blocks == 5


def test_exhaustion_fragmentation_and_oversize():
    a = EmbeddingBlockAllocator(num_blocks=4, block_size=2, default_blocks=2)
    first, second = a.alloc(2, "a"), a.alloc(2, "b")
    a.alloc(4, "c")
    with pytest.raises(BlocksExhaustedError):
        a.alloc(1, "d")
    a.free(first, "a")
    a.free(a._live[2][0], "c")  # blocks 0 and 2..3 free, 1 held: no run of 3
    with pytest.raises(BlocksExhaustedError, match="contiguous"):
        a.alloc(6, "e")
    with pytest.raises(BlocksExhaustedError, match="has 4"):
        a.alloc(9, "e")
    a.free(second, "b")
    assert a.used_blocks == 0 and a.alloc(8, "f") == BlockAllocation(0, 4, 8)


def test_free_checks_the_owner_and_double_free():
    a = EmbeddingBlockAllocator(num_blocks=4, block_size=2, default_blocks=1)
    x = a.alloc(3, "x")
    with pytest.raises(ValueError, match="not held"):
        a.free(x, "other")
    a.free(x, "x")
    with pytest.raises(ValueError, match="not held"):
        a.free(x, "x")


def test_config_is_validated():
    with pytest.raises(ValueError, match="default_blocks"):
        EmbeddingBlockAllocator(num_blocks=4, block_size=2, default_blocks=5)
    with pytest.raises(ValueError, match="num_tokens"):
        EmbeddingBlockAllocator(4, 2, 1).alloc(0, "x")


def test_buffers_write_read_chunk_info_and_aux():
    a = EmbeddingBlockAllocator(num_blocks=8, block_size=4, default_blocks=2)
    b = EmbeddingBuffers(8, 4, hidden=3)
    a.alloc(4, "pad")
    alloc = a.alloc(10, "r")  # blocks 1..3, rows 4..15
    data = torch.arange(30, dtype=torch.float32).view(10, 3)
    b.write(alloc, data, true_length=25)
    rows, aux = b.read(alloc, 6, offset=4)
    assert aux == 25 and torch.equal(rows, data[4:10])
    assert b.chunk_info(alloc, offset_tokens=4, max_tokens=100) == ((4 + 4) * 12, 6 * 12)
    with pytest.raises(ValueError):
        b.write(alloc, torch.zeros(11, 3), 11)


def test_blocks_used_metric():
    a = EmbeddingBlockAllocator(num_blocks=8, block_size=4, default_blocks=2)
    reg = CollectorRegistry()
    reg.register(MmBlocksCollector(a))
    x = a.alloc_default("r")
    assert reg.get_sample_value("tandem_worker_mm_blocks_used") == 2
    a.free(x, "r")
    assert reg.get_sample_value("tandem_worker_mm_blocks_used") == 0
    assert reg.get_sample_value("tandem_worker_mm_blocks_total") == 8
