"""The decode K/V gather's reused buffer: one storage grown to the largest gather, and
decode attention through it equal to attention through a fresh gather every layer."""

from __future__ import annotations

import torch

from services.engine.layers.attention import GatherBuffer, build_attention_metadata, paged_attention


def test_take_reuses_grows_and_follows_dtype() -> None:
    buf = GatherBuffer()
    like = torch.zeros(1)
    a = buf.take((2, 3, 4), like)
    assert a.shape == (2, 3, 4) and a.dtype == torch.float32
    b = buf.take((2, 2, 4), like)  # smaller: the same storage
    assert b.data_ptr() == a.data_ptr()
    c = buf.take((4, 3, 4), like)  # larger: grown
    assert c.shape == (4, 3, 4) and c.data_ptr() != a.data_ptr()
    assert buf.take((2, 3, 4), like).data_ptr() == c.data_ptr()
    d = buf.take((2, 3, 4), torch.zeros(1, dtype=torch.bfloat16))
    assert d.dtype == torch.bfloat16


def test_decode_attention_through_the_buffer_equals_a_fresh_gather() -> None:
    gen = torch.Generator().manual_seed(0)
    bs, hkv, hq, hd = 4, 2, 4, 8
    cache = torch.randn(2, 32, bs, hkv, hd, generator=gen)
    decodes = [(9, [3, 7, 1]), (2, [5]), (14, [8, 9, 10, 11])]  # (position, blocks)
    buf = GatherBuffer()
    outs = []
    for gather in (None, buf, buf):  # twice through the buffer: reuse leaves nothing stale
        c = cache.clone()
        meta = build_attention_metadata([], decodes, bs, torch.device("cpu"), torch.float32, gather)
        assert meta.decode is not None and meta.decode.gather is gather
        q = torch.randn(3, hq, hd, generator=torch.Generator().manual_seed(1))
        k = torch.randn(3, hkv, hd, generator=torch.Generator().manual_seed(2))
        v = torch.randn(3, hkv, hd, generator=torch.Generator().manual_seed(3))
        outs.append(paged_attention(q, k, v, c, meta))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
