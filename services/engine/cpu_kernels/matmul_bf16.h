// The int4 matmul for CPUs with AVX512-BF16: bfloat16 activations, vdpbf16ps over the
// codes unpacked to bfloat16 pairs ("pairs" layout in quant/pack.py), no activation rounding.
#pragma once

#include "pool.h"
#include "simd.h"
#include "weight.h"

#include <immintrin.h>

#include <vector>

namespace {

using simd::f32_to_bf16;

constexpr bool kFloatInput = false;  // bfloat16 activations only
// Rows a tile pass takes at once: accumulators for 8 rows (24 of the 32 vector registers)
// halve the code unpacks of 4-row blocks.
constexpr int kRowBlock = 8;

inline __m512 load_bf16x16(const uint16_t* p) { return simd::load_bf16(p).v; }
inline __m512 load_f16x16(const uint16_t* p) { return simd::load_f16(p).v; }

// 16 bytes of codes -> 16 output rows' (k, k + 1) pairs as bfloat16 0.0 .. 15.0, the
// word pairs vdpbf16ps multiplies with one broadcast input pair. vpermw reads an index's
// low 5 bits, so the garbage above each nibble picks the same entry of a 32-entry table.
inline __m512i unpack_pairs(const uint8_t* p, __m512i table) {
  const __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i idx = _mm512_mask_blend_epi16(0xAAAAAAAAu, t, _mm512_slli_epi32(t, 12));
  return _mm512_permutexvar_epi16(idx, table);
}

inline __m512i code_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = f32_to_bf16(static_cast<float>(i & 15));
  return _mm512_load_si512(t);
}

// One tile (16 output rows) for MB input rows. Two accumulators a row (even and odd input
// pairs) keep two vdpbf16ps chains in flight; the group's scale and min apply once per
// 16 pairs, and the outputs stay in lanes: no horizontal sums.
template <int MB>
inline void gemv_tile(const Int4Weight& w, int64_t tile, const uint16_t* x, int64_t kx, const float* gsum,
                      const float* bias, float* y, int64_t ldy, __m512i table) {
  const int64_t xgroups = kx / kGroup;
  const uint8_t* c = w.codes + tile * w.groups * 256;
  const uint16_t* sm = w.sm + tile * w.groups * 32;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const int32_t* xg[MB];
    for (int m = 0; m < MB; ++m) xg[m] = reinterpret_cast<const int32_t*>(x + m * kx + (g % xgroups) * kGroup);
    __m512 even[MB], odd[MB];
    for (int m = 0; m < MB; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    const uint8_t* cg = c + g * 256;
    _mm_prefetch(reinterpret_cast<const char*>(cg + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cg + 1088), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cg + 1152), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cg + 1216), _MM_HINT_T0);
    for (int p = 0; p < 16; p += 2) {
      const __m512bh q0 = (__m512bh)unpack_pairs(cg + p * 16, table);
      const __m512bh q1 = (__m512bh)unpack_pairs(cg + p * 16 + 16, table);
      for (int m = 0; m < MB; ++m) {
        even[m] = _mm512_dpbf16_ps(even[m], q0, (__m512bh)_mm512_set1_epi32(xg[m][p]));
        odd[m] = _mm512_dpbf16_ps(odd[m], q1, (__m512bh)_mm512_set1_epi32(xg[m][p + 1]));
      }
    }
    const __m512 scale = load_f16x16(sm + g * 32), mins = load_f16x16(sm + g * 32 + 16);
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_add_ps(even[m], odd[m]), scale, acc[m]);
      acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(gsum[m * w.groups + g]), acc[m]);
    }
  }
  const int64_t n0 = tile * 16, left = w.n - n0;
  const __mmask16 k = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy + n0, k, _mm512_add_ps(acc[m], b));
}

// gsum[m, g] for the weight's groups: the sum of the inputs group g reads (the min term),
// reading the input cyclically where the weight is wider (input_repeat).
void group_sums(const uint16_t* x, int64_t rows, int64_t kx, int64_t wgroups, float* out) {
  const int64_t xgroups = kx / kGroup;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t g = 0; g < xgroups; ++g) {
      const uint16_t* p = x + m * kx + g * kGroup;
      out[m * wgroups + g] = _mm512_reduce_add_ps(_mm512_add_ps(load_bf16x16(p), load_bf16x16(p + 16)));
    }
    for (int64_t g = xgroups; g < wgroups; ++g) out[m * wgroups + g] = out[m * wgroups + g % xgroups];
  }
}

// y[m, n] = sum_k x[m, k mod kx] * w[n, k] (+ bias[n]); x bfloat16 (rows, kx), y float32
// (rows, ldy). A task is a few tiles, each for every row in blocks of MB (one unpack of
// the codes feeds every row of a block): a tile's codes are read from memory once a call
// and stay in L1 across the row blocks, where a pass over the whole weight per row block
// read a batch's weights rows / 4 times. The group sums go into a buffer kept across calls.
void int4_matmul(const Int4Weight& w, const uint16_t* x, int64_t rows, int64_t kx, const float* bias, float* y,
                 int64_t ldy) {
  TORCH_CHECK((w.groups * kGroup) % kx == 0, "int4 weight: ", w.groups * kGroup, " inputs do not repeat an input of ", kx);
  thread_local std::vector<float> gsum;
  gsum.resize(rows * w.groups);
  group_sums(x, rows, kx, w.groups, gsum.data());
  const float* gs = gsum.data();
  const __m512i table = code_table();
  parallel_for(w.tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t m = 0;
      for (; m + kRowBlock <= rows; m += kRowBlock)
        gemv_tile<kRowBlock>(w, t, x + m * kx, kx, gs + m * w.groups, bias, y + m * ldy, ldy, table);
      for (; m + 4 <= rows; m += 4) gemv_tile<4>(w, t, x + m * kx, kx, gs + m * w.groups, bias, y + m * ldy, ldy, table);
      for (; m + 2 <= rows; m += 2) gemv_tile<2>(w, t, x + m * kx, kx, gs + m * w.groups, bias, y + m * ldy, ldy, table);
      for (; m < rows; ++m) gemv_tile<1>(w, t, x + m * kx, kx, gs + m * w.groups, bias, y + m * ldy, ldy, table);
    }
  });
}

}  // namespace
