"""`tandem bench engine`'s decode phase: what it times is n sequences decoding together."""

from __future__ import annotations

import torch

from services.bench.engine import bench_decode
from tests.support.engine_factory import make_engine, mock_cfg


def test_every_sequence_decodes_through_the_window_when_prefill_takes_many_steps() -> None:
    # 4 prompts of 64 tokens through a 32-token budget: 8 steps of prefill, during which the
    # first prompts would decode and, at 6 + 4 tokens each, finish inside the timed window
    eng, _, _ = make_engine(mock_cfg(max_num_batched_tokens=32, num_kv_blocks=128, max_num_seqs=8,
                                     max_model_len=256))
    out = bench_decode(eng, 4, 6, 64, 2, torch.Generator().manual_seed(0))
    assert out["seqs_per_step"] == 4
    assert out["tok_s"] > 0
    assert not eng.has_unfinished()
    eng.check_integrity()
