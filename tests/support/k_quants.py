"""Simple (not error-optimal) Q4_K and Q6_K quantizers for tests.

gguf-py can dequantize K-quants but not quantize them, so these pack blocks in ggml's
layout (block_q4_K / block_q6_K, 256 values per block) with plain max-abs / min-max
scales. Input: float32 [rows, cols] with cols % 256 == 0; output: uint8 [rows, bytes].
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """block_q6_K: ql[128] (low nibbles), qh[64] (high 2 bits), scales[16] int8, d fp16."""
    rows, cols = w.shape
    x = w.reshape(-1, QK_K).astype(np.float32)  # (n, 256)
    sub = x.reshape(len(x), 16, 16)  # 16 sub-blocks of 16 values
    sub_scale = np.abs(sub).max(axis=-1) / 31.0  # (n, 16) so |q| <= 31
    d = (np.abs(sub_scale).max(axis=-1, keepdims=True) / 127.0).astype(np.float16)  # (n, 1)
    scales = np.clip(np.round(_safe_div(sub_scale, d.astype(np.float32))), -128, 127).astype(np.int8)
    step = (d.astype(np.float32) * scales)[..., None]  # (n, 16, 1)
    q = np.clip(np.round(_safe_div(sub, np.broadcast_to(step, sub.shape))), -32, 31).astype(np.int16) + 32
    q = q.reshape(len(x), QK_K).astype(np.uint8)  # 0..63
    low, high = q & 0x0F, q >> 4
    low = low.reshape(-1, 2, 2, 64)  # element j = a*128 + s*64 + b -> nibble s of ql[a*64 + b]
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = high.reshape(-1, 2, 4, 32)  # element j = a*128 + s*32 + b -> bits 2s of qh[a*32 + b]
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, scales.view(np.uint8), d.view(np.uint8)], axis=1)  # (n, 210)
    return blocks.reshape(rows, cols // QK_K * blocks.shape[1])


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """block_q4_K: d fp16, dmin fp16, 12 bytes of 6-bit (scale, min) x 8, qs[128] nibbles.
    value = d * sc[i] * q - dmin * m[i] over 8 sub-blocks of 32."""
    rows, cols = w.shape
    x = w.reshape(-1, QK_K).astype(np.float32)
    n = len(x)
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # (n, 8); the offset is -min >= 0
    sub_scale = (sub.max(axis=-1) - lo) / 15.0
    sub_min = -lo
    d = (sub_scale.max(axis=-1, keepdims=True) / 63.0).astype(np.float16)
    dmin = (sub_min.max(axis=-1, keepdims=True) / 63.0).astype(np.float16)
    sc = np.clip(np.round(_safe_div(sub_scale, d.astype(np.float32))), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_safe_div(sub_min, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32) * sc)[..., None]  # (n, 8, 1)
    offset = (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.round(_safe_div(sub + offset, np.broadcast_to(step, sub.shape))), 0, 15).astype(np.uint8)
    q = q.reshape(n, 4, 2, 32)  # element j = a*64 + s*32 + b -> nibble s of qs[a*32 + b]
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    packed = np.empty((n, 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qs], axis=1)  # (n, 144)
    return blocks.reshape(rows, cols // QK_K * blocks.shape[1])
