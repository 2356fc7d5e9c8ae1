// The int4 matmul over int8 activations, for CPUs without AVX512-BF16 (the way llama.cpp's
// Q4 x Q8 dot products reach their speed): each row of the input is quantized per 32-wide
// group to int8 (one float scale per group, and the group's sum for the weights' min
// term), the 4-bit codes (0..15, unsigned) times the int8 inputs summed in int32 by
// vpdpbusd (AVX512-VNNI, or AVX-VNNI on 256 bits), vpmaddubsw (+ vpmaddwd once a group),
// or NEON's sdot
// (the codes fit a signed byte), then per group
//   y += scale_w * scale_x * dot + min_w * scale_x * sum(xq).
//
// Codes ("quads" layout in quant/pack.py): per tile and group, 4 chunks of 64 bytes; in chunk j
// the 4 bytes of lane i (output row i) hold that row's inputs 4j..4j+3 in their low
// nibbles and 16+4j..16+4j+3 in their high nibbles. One AND (and one shift) gives a
// vector whose every 32-bit lane is a row's 4 codes: vpdpbusd's operand as loaded, with
// one broadcast of 4 int8 inputs. Under AVX2 a chunk's two halves are rows 0-7 and 8-15;
// under NEON its four q registers are rows 0-3, 4-7, 8-11 and 12-15.
//
// Every set computes each output the same way (exact int32 dot products, then the same
// float32 operations in the same order), so their results are bit-identical.
#pragma once

#include "pool.h"
#include "simd.h"
#include "weight.h"

#if !defined(__aarch64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr bool kFloatInput = true;  // bfloat16 or float32 activations

// Rows of int8 inputs: q (rows, kx), per row and group its scale d and d * sum(q).
struct QuantX {
  const int8_t* q;
  const float* d;
  const float* ds;
  int64_t kx, groups;
};

#if defined(__aarch64__)
constexpr bool kStreams = false;  // NEON's output writes are unmeasured

inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const uint16_t* p) { return simd::bf16x4(p); }

// One 32-wide group: 32 int8 at q, returns (scale, sum of q).
template <class T>
inline void quantize_group(const T* x, int8_t* q, float& d, int32_t& sum) {
  float32x4_t v[8];
  float32x4_t m = vdupq_n_f32(0.0f);
  for (int i = 0; i < 8; ++i) m = vmaxq_f32(m, vabsq_f32(v[i] = load4(x + 4 * i)));
  const float amax = vmaxvq_f32(m);
  d = amax / 127.0f;
  const float32x4_t inv = vdupq_n_f32(amax > 0 ? 127.0f / amax : 0.0f);
  int32x4_t n[8];
  int32x4_t s = vdupq_n_s32(0);
  for (int i = 0; i < 8; ++i) s = vaddq_s32(s, n[i] = vcvtnq_s32_f32(vmulq_f32(v[i], inv)));  // ties to even
  sum = vaddvq_s32(s);
  for (int h = 0; h < 2; ++h) {
    const int16x8_t a = vcombine_s16(vqmovn_s32(n[4 * h]), vqmovn_s32(n[4 * h + 1]));
    const int16x8_t b = vcombine_s16(vqmovn_s32(n[4 * h + 2]), vqmovn_s32(n[4 * h + 3]));
    vst1q_s8(q + 16 * h, vcombine_s8(vqmovn_s16(a), vqmovn_s16(b)));
  }
}

// One tile (16 output rows, four q registers of 4) for MB input rows starting at row m0.
template <int MB>
inline void gemv_tile(const Int4Weight& w, int64_t tile, const QuantX& x, int64_t m0, const float* bias, float* y,
                      int64_t ldy, bool stream) {
  const uint8_t* c = w.codes + tile * w.groups * 256;
  const uint16_t* sm = w.sm + tile * w.groups * 32;
  (void)stream;  // kStreams is false here
  const uint8x16_t nib = vdupq_n_u8(0x0f);
  float32x4_t acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = vdupq_n_f32(0.0f);
  for (int64_t g = 0, xg = 0; g < w.groups; ++g, xg = xg + 1 == x.groups ? 0 : xg + 1) {
    const uint8_t* cg = c + g * 256;
    for (int k = 0; k < 4; ++k) __builtin_prefetch(cg + 1024 + 64 * k);
    int32x4_t dot[MB][4];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < 4; ++r) dot[m][r] = vdupq_n_s32(0);
    for (int j = 0; j < 4; ++j) {
      for (int r = 0; r < 4; ++r) {
        const uint8x16_t v = vld1q_u8(cg + 64 * j + 16 * r);
        const int8x16_t cl = vreinterpretq_s8_u8(vandq_u8(v, nib)), ch = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        for (int m = 0; m < MB; ++m) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(x.q + (m0 + m) * x.kx + xg * kGroup);
          dot[m][r] = vdotq_s32(dot[m][r], cl, vreinterpretq_s8_s32(vdupq_n_s32(xq[j])));
          dot[m][r] = vdotq_s32(dot[m][r], ch, vreinterpretq_s8_s32(vdupq_n_s32(xq[4 + j])));
        }
      }
    }
    for (int r = 0; r < 4; ++r) {
      const float32x4_t scale = simd::f16x4(sm + g * 32 + 4 * r), mins = simd::f16x4(sm + g * 32 + 16 + 4 * r);
      for (int m = 0; m < MB; ++m) {
        const int64_t i = (m0 + m) * x.groups + xg;
        acc[m][r] = vfmaq_f32(acc[m][r], vcvtq_f32_s32(dot[m][r]), vmulq_n_f32(scale, x.d[i]));
        acc[m][r] = vfmaq_n_f32(acc[m][r], mins, x.ds[i]);
      }
    }
  }
  const int64_t n0 = tile * 16, left = std::min<int64_t>(16, w.n - n0);
  for (int m = 0; m < MB; ++m) {
    alignas(16) float out[16];
    for (int r = 0; r < 4; ++r) vst1q_f32(out + 4 * r, acc[m][r]);
    float* row = y + (m0 + m) * ldy + n0;
    for (int64_t i = 0; i < left; ++i) row[i] = out[i] + (bias ? bias[n0 + i] : 0.0f);
  }
}
#elif defined(__AVX512F__)
// Its whole-line stores measured no faster streamed (850 x 576 -> 3072: 13.7 vs 12.8 ms).
constexpr bool kStreams = false;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return simd::load_bf16(p).v; }

// One 32-wide group: 32 int8 at q, returns (scale, sum of q).
template <class T>
inline void quantize_group(const T* x, int8_t* q, float& d, int32_t& sum) {
  const __m512 a = load16(x), b = load16(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  d = amax / 127.0f;
  const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // round to nearest even
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
}

// Chunk j of a group into (lo, hi): low-nibble codes by inputs 4j.., high by 16+4j... With
// VNNI each in int32 by vpdpbusd. Without, vpmaddubsw's int16 pair sums are added in
// int16 (each at most 2 * 15 * 127 = 3810 in magnitude, a group's eight 30480 < 32767)
// and widened once a group by dot_sum, not once a chunk: a third fewer instructions.
inline void dot_chunk(__m512i& lo, __m512i& hi, __m512i cl, __m512i ch, __m512i xl, __m512i xh) {
#if defined(__AVX512VNNI__)
  lo = _mm512_dpbusd_epi32(lo, cl, xl);
  hi = _mm512_dpbusd_epi32(hi, ch, xh);
#else
  (void)hi;
  lo = _mm512_add_epi16(lo, _mm512_add_epi16(_mm512_maddubs_epi16(cl, xl), _mm512_maddubs_epi16(ch, xh)));
#endif
}

inline __m512i dot_sum(__m512i lo, __m512i hi) {
#if defined(__AVX512VNNI__)
  return _mm512_add_epi32(lo, hi);
#else
  (void)hi;
  return _mm512_madd_epi16(lo, _mm512_set1_epi16(1));
#endif
}

// One tile (16 output rows, one a lane) for MB input rows starting at row m0.
template <int MB>
inline void gemv_tile(const Int4Weight& w, int64_t tile, const QuantX& x, int64_t m0, const float* bias, float* y,
                      int64_t ldy, bool stream) {
  const uint8_t* c = w.codes + tile * w.groups * 256;
  const uint16_t* sm = w.sm + tile * w.groups * 32;
  const __m512i nib = _mm512_set1_epi8(0x0f);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0, xg = 0; g < w.groups; ++g, xg = xg + 1 == x.groups ? 0 : xg + 1) {
    const uint8_t* cg = c + g * 256;
    _mm_prefetch(reinterpret_cast<const char*>(cg + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cg + 1088), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cg + 1152), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cg + 1216), _MM_HINT_T0);
    __m512i lo[MB], hi[MB];
    for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(cg + 64 * j);
      const __m512i cl = _mm512_and_si512(v, nib), ch = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      for (int m = 0; m < MB; ++m) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(x.q + (m0 + m) * x.kx + xg * kGroup);
        dot_chunk(lo[m], hi[m], cl, ch, _mm512_set1_epi32(xq[j]), _mm512_set1_epi32(xq[4 + j]));
      }
    }
    const __m512 scale = simd::load_f16(sm + g * 32).v, mins = simd::load_f16(sm + g * 32 + 16).v;
    for (int m = 0; m < MB; ++m) {
      const int64_t i = (m0 + m) * x.groups + xg;
      const __m512 dot = _mm512_cvtepi32_ps(dot_sum(lo[m], hi[m]));
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(x.d[i])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(x.ds[i]), acc[m]);
    }
  }
  const int64_t n0 = tile * 16, left = w.n - n0;
  const __mmask16 k = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
  (void)stream;  // kStreams is false here
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * ldy + n0, k, _mm512_add_ps(acc[m], b));
}
#else
constexpr bool kStreams = true;  // whole tiles of a large output (gemv_tile)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return simd::bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

template <class T>
inline void quantize_group(const T* x, int8_t* q, float& d, int32_t& sum) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i] = load8(x + 8 * i)));
  const float amax = hmax(m);
  d = amax / 127.0f;
  const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round to nearest even
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  sum = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
  // packs interleave 128-bit lanes: the permute restores the inputs' order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// As the AVX-512 dot_chunk and dot_sum, on 256 bits (AVX-VNNI's vpdpbusd where present).
inline void dot_chunk(__m256i& lo, __m256i& hi, __m256i cl, __m256i ch, __m256i xl, __m256i xh) {
#if defined(__AVXVNNI__)
  lo = _mm256_dpbusd_avx_epi32(lo, cl, xl);
  hi = _mm256_dpbusd_avx_epi32(hi, ch, xh);
#else
  (void)hi;
  lo = _mm256_add_epi16(lo, _mm256_add_epi16(_mm256_maddubs_epi16(cl, xl), _mm256_maddubs_epi16(ch, xh)));
#endif
}

inline __m256i dot_sum(__m256i lo, __m256i hi) {
#if defined(__AVXVNNI__)
  return _mm256_add_epi32(lo, hi);
#else
  (void)hi;
  return _mm256_madd_epi16(lo, _mm256_set1_epi16(1));
#endif
}

// Keeps v in a register at this point. Without it GCC reassociates a group's int16 sums
// (exact either way) into one tree at the group's end: the products it holds until then
// spill to the stack, and so do the float accumulators. On an AVX2-only Zen 4 it was worth
// 5-15% with a pass per half, 1.33-1.43x with both halves a pass (docs/benchmarks.md "AMD
// EPYC without AVX-512").
inline void pin(__m256i& v) { asm volatile("" : "+x"(v)); }

// Halves of a tile's 16 outputs a pass over its codes, at MB rows. Both: each input
// broadcast then feeds 16 outputs. At 4 rows that holds more than AVX2's 16 registers and
// some sums spill, but a pass per half (which fit) had to broadcast every input twice and
// was 1.28x slower on an AVX2-only Zen 4. With AVX-VNNI a row's half keeps two int32 sums,
// so 4 rows in one pass would want 24 registers: there 4 rows keep a pass per half, as
// before (no AVX-VNNI machine was at hand to measure either way).
#if defined(__AVXVNNI__)
template <int MB>
constexpr int kHalvesPerPass = MB >= 4 ? 1 : 2;
#else
template <int MB>
constexpr int kHalvesPerPass = 2;
#endif

// One tile (16 output rows) for MB input rows starting at row m0, in two halves of 8 rows.
template <int MB>
inline void gemv_tile(const Int4Weight& w, int64_t tile, const QuantX& x, int64_t m0, const float* bias, float* y,
                      int64_t ldy, bool stream) {
  constexpr int H = kHalvesPerPass<MB>;
  const uint8_t* c = w.codes + tile * w.groups * 256;
  const uint16_t* sm = w.sm + tile * w.groups * 32;
  const __m256i nib = _mm256_set1_epi8(0x0f);
  const int64_t n0 = tile * 16, left = w.n - n0;
  const int halves = left > 8 ? 2 : 1;
  // The rows' inputs and scales as locals: read through x, each row's address was
  // recomputed (and x.kx reloaded) at every group.
  const int64_t kx = x.kx, xgroups = x.groups;
  const int8_t* const xrow = x.q + m0 * kx;
  const float* const drow = x.d + m0 * xgroups;
  const float* const dsrow = x.ds + m0 * xgroups;
  __m256 acc[MB][2];
  for (int p = 0; p < halves; p += H) {
    __m256 a[MB][H];  // this pass's sums, in registers (acc is indexed by the pass)
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < H; ++h) a[m][h] = _mm256_setzero_ps();
    for (int64_t g = 0, xg = 0; g < w.groups; ++g, xg = xg + 1 == xgroups ? 0 : xg + 1) {
      const uint8_t* cg = c + g * 256 + 32 * p;
      const int8_t* xb = xrow + xg * kGroup;
      __m256i lo[MB][H], hi[MB][H];
      for (int m = 0; m < MB; ++m)
        for (int h = 0; h < H; ++h) lo[m][h] = hi[m][h] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        __m256i cl[H], ch[H];
        for (int h = 0; h < H; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 64 * j + 32 * h));
          cl[h] = _mm256_and_si256(v, nib);
          ch[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        for (int m = 0; m < MB; ++m) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(xb + m * kx);
          const __m256i xl = _mm256_set1_epi32(xq[j]), xh = _mm256_set1_epi32(xq[4 + j]);
          for (int h = 0; h < H; ++h) {
            dot_chunk(lo[m][h], hi[m][h], cl[h], ch[h], xl, xh);
            pin(lo[m][h]);
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        const uint16_t* s = sm + g * 32 + 8 * (p + h);
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
        const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)));
        for (int m = 0; m < MB; ++m) {
          const int64_t i = m * xgroups + xg;
          const __m256 dot = _mm256_cvtepi32_ps(dot_sum(lo[m][h], hi[m][h]));
          a[m][h] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(drow[i])), a[m][h]);
          a[m][h] = _mm256_fmadd_ps(mins, _mm256_set1_ps(dsrow[i]), a[m][h]);
        }
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < H; ++h) acc[m][p + h] = a[m][h];
  }
  // A whole tile is stored as whole 64-byte lines: stored one half at a time, a line of a
  // large output was read in from memory first (2x the matmul's time at 850 rows), and
  // only whole lines can be streamed past the cache.
  if (left >= 16) {
    const __m256 b0 = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + n0 + 8) : _mm256_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      float* row = y + (m0 + m) * ldy + n0;
      if (stream) {
        _mm256_stream_ps(row, _mm256_add_ps(acc[m][0], b0));
        _mm256_stream_ps(row + 8, _mm256_add_ps(acc[m][1], b1));
      } else {
        _mm256_storeu_ps(row, _mm256_add_ps(acc[m][0], b0));
        _mm256_storeu_ps(row + 8, _mm256_add_ps(acc[m][1], b1));
      }
    }
    return;
  }
  for (int m = 0; m < MB; ++m) {
    for (int h = 0; h < halves; ++h) {
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[m][h]);
      float* row = y + (m0 + m) * ldy + n0 + 8 * h;
      for (int64_t i = 0; i < std::min<int64_t>(8, left - 8 * h); ++i)
        row[i] = out[i] + (bias ? bias[n0 + 8 * h + i] : 0.0f);
    }
  }
}
#endif

// Quantizes rows (rows, kx) of x into buffers kept across calls (one set a calling
// thread), on the pool: serial, a pass over 850 rows was ~5% of an AVX2 matmul at 2 threads.
template <class T>
QuantX quantize_rows(const T* x, int64_t rows, int64_t kx) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, ds;
  const int64_t groups = kx / kGroup;
  q.resize(rows * kx);
  d.resize(rows * groups);
  ds.resize(rows * groups);
  int8_t* qp = q.data();
  float *dp = d.data(), *dsp = ds.data();
  parallel_for(rows * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int32_t sum;
      quantize_group(x + i * kGroup, qp + i * kGroup, dp[i], sum);
      dsp[i] = dp[i] * static_cast<float>(sum);
    }
  });
  return {qp, dp, dsp, kx, groups};
}

// Outputs at least this large are written past the cache where kStreams (non-temporal stores, whole
// lines): larger than a core's L2, their lines would be read in from memory only to be
// overwritten.
constexpr int64_t kStreamBytes = int64_t{2} << 20;

// y[m, n] = sum_k x[m, k mod kx] * w[n, k] (+ bias[n]); x bfloat16 or float32 (rows, kx),
// y float32 (rows, ldy). Tasks are (block of 32 rows, tiles): the block's int8 inputs stay
// in L1 while its tasks run, in order, over the tiles; within a tile every 4 rows share
// one unpack of the codes.
template <class T>
void int4_matmul(const Int4Weight& w, const T* x, int64_t rows, int64_t kx, const float* bias, float* y,
                 int64_t ldy) {
  TORCH_CHECK((w.groups * kGroup) % kx == 0, "int4 weight: ", w.groups * kGroup, " inputs do not repeat an input of ", kx);
  const QuantX xq = quantize_rows(x, rows, kx);
  constexpr int64_t kRowBlock = 32;
  const bool stream = kStreams && rows * ldy * static_cast<int64_t>(sizeof(float)) >= kStreamBytes && ldy % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(y) % 64 == 0;
  const int64_t grain = rows >= 8 ? 1 : 4, chunks = (w.tiles + grain - 1) / grain;
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  parallel_for(chunks * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = i / chunks * kRowBlock, r1 = std::min(rows, r0 + kRowBlock);
      const int64_t t1 = std::min(w.tiles, (i % chunks + 1) * grain);
      for (int64_t t = i % chunks * grain; t < t1; ++t) {
        int64_t m = r0;
        for (; m + 4 <= r1; m += 4) gemv_tile<4>(w, t, xq, m, bias, y, ldy, stream);
        for (; m + 2 <= r1; m += 2) gemv_tile<2>(w, t, xq, m, bias, y, ldy, stream);
        for (; m < r1; ++m) gemv_tile<1>(w, t, xq, m, bias, y, ldy, stream);
      }
    }
#if !defined(__aarch64__)
    if (stream) _mm_sfence();  // streamed stores are weakly ordered: done before the task is
#endif
  });
}

}  // namespace
