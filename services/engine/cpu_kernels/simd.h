// 16 float32 lanes for the kernels' elementwise work (norms, rotary, attention, SiLU), on
// whatever vector width the translation unit is compiled for: one zmm under AVX-512, two
// ymm under AVX2, four q registers under NEON. bfloat16 <-> float32 is integer shifts, so
// no path needs AVX512-BF16 outside the bf16 matmul.
#pragma once

#if defined(__aarch64__)
#include <arm_neon.h>
#else
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace simd {

#if defined(__aarch64__)
struct vf {
  float32x4_t v[4];
};
constexpr int kRegisters = 4;         // vector registers a vf takes
constexpr int kVectorRegisters = 32;  // the set's
// Each operation on the 4 registers (the loops unroll).
#define TANDEM_VF_MAP2(name, op)                           \
  inline vf name(vf a, vf b) {                             \
    vf r;                                                  \
    for (int i = 0; i < 4; ++i) r.v[i] = op(a.v[i], b.v[i]); \
    return r;                                              \
  }
TANDEM_VF_MAP2(operator+, vaddq_f32)
TANDEM_VF_MAP2(operator-, vsubq_f32)
TANDEM_VF_MAP2(operator*, vmulq_f32)
TANDEM_VF_MAP2(operator/, vdivq_f32)
TANDEM_VF_MAP2(max, vmaxq_f32)
TANDEM_VF_MAP2(min, vminq_f32)
#undef TANDEM_VF_MAP2
inline vf set1(float x) {
  const float32x4_t s = vdupq_n_f32(x);
  return {{s, s, s, s}};
}
inline vf zero() { return set1(0.0f); }
inline vf load(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline void store(float* p, vf a) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, a.v[i]);
}
inline vf fmadd(vf a, vf b, vf c) {
  vf r;
  for (int i = 0; i < 4; ++i) r.v[i] = vfmaq_f32(c.v[i], a.v[i], b.v[i]);
  return r;
}
inline vf round(vf a) {  // to nearest, ties to even
  vf r;
  for (int i = 0; i < 4; ++i) r.v[i] = vrndnq_f32(a.v[i]);
  return r;
}
// a * 2^n for integral n in [-126, 127]: n becomes the exponent field of a float.
inline vf ldexp(vf a, vf n) {
  vf r;
  for (int i = 0; i < 4; ++i) {
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n.v[i]), vdupq_n_s32(127)), 23);
    r.v[i] = vmulq_f32(a.v[i], vreinterpretq_f32_s32(e));
  }
  return r;
}
// In the x86 sets' order (x_j + x_j+8, then j + j+4, j + j+2, 0 + 1): the same bits on every set.
inline float sum(vf a) {
  const float32x4_t u = vaddq_f32(vaddq_f32(a.v[0], a.v[2]), vaddq_f32(a.v[1], a.v[3]));
  const float32x2_t v = vadd_f32(vget_low_f32(u), vget_high_f32(u));
  return vget_lane_f32(v, 0) + vget_lane_f32(v, 1);
}
// Lane i of the result: sum(a[i]), added in the same order.
__attribute__((always_inline)) inline vf sum16(const vf* a) {
  float32x4_t u[16];
  for (int i = 0; i < 16; ++i) u[i] = vaddq_f32(vaddq_f32(a[i].v[0], a[i].v[2]), vaddq_f32(a[i].v[1], a[i].v[3]));
  vf r;
  for (int g = 0; g < 4; ++g) {
    const float32x4_t* x = u + 4 * g;
    const float32x4_t p = vaddq_f32(vcombine_f32(vget_low_f32(x[0]), vget_low_f32(x[1])),
                                    vcombine_f32(vget_high_f32(x[0]), vget_high_f32(x[1])));
    const float32x4_t q = vaddq_f32(vcombine_f32(vget_low_f32(x[2]), vget_low_f32(x[3])),
                                    vcombine_f32(vget_high_f32(x[2]), vget_high_f32(x[3])));
    r.v[g] = vpaddq_f32(p, q);
  }
  return r;
}
inline float32x4_t bf16x4(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
inline vf load_bf16(const uint16_t* p) { return {{bf16x4(p), bf16x4(p + 4), bf16x4(p + 8), bf16x4(p + 12)}}; }
inline float32x4_t f16x4(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
inline vf load_f16(const uint16_t* p) { return {{f16x4(p), f16x4(p + 4), f16x4(p + 8), f16x4(p + 12)}}; }
#elif defined(__AVX512F__)
struct vf {
  __m512 v;
};
constexpr int kRegisters = 1;
constexpr int kVectorRegisters = 32;
inline vf zero() { return {_mm512_setzero_ps()}; }
inline vf set1(float x) { return {_mm512_set1_ps(x)}; }
inline vf load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, vf a) { _mm512_storeu_ps(p, a.v); }
inline vf operator+(vf a, vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vf operator-(vf a, vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vf operator*(vf a, vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vf operator/(vf a, vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline vf max(vf a, vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline vf min(vf a, vf b) { return {_mm512_min_ps(a.v, b.v)}; }
inline vf round(vf a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline vf ldexp(vf a, vf n) { return {_mm512_scalef_ps(a.v, n.v)}; }  // a * 2^n, n integral
inline float sum(vf a) { return _mm512_reduce_add_ps(a.v); }
// Lane i of the result: sum(a[i]) added in sum()'s order (GCC's _mm512_reduce_add_ps:
// x_j + x_j+8, then j + j+4, then j + j+2, then 0 + 1), so the scores are the bits a sum
// per key gave, on every set.
__attribute__((always_inline)) inline vf sum16(const vf* a) {
  __m512 t[8], u[4], v[2];
  for (int k = 0; k < 8; ++k)  // the 256-bit halves of a[2k] (lanes 0-7) and a[2k+1] (8-15)
    t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k].v, a[2 * k + 1].v, 0x44),
                         _mm512_shuffle_f32x4(a[2 * k].v, a[2 * k + 1].v, 0xee));
  for (int k = 0; k < 4; ++k)  // 128-bit lane l: a[4k + l]'s four j + j+4
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0xdd));
  for (int k = 0; k < 2; ++k) {  // lane l: j + j+2 of a[8k + l], then of a[8k + 4 + l]
    const __m512d p = _mm512_castps_pd(u[2 * k]), q = _mm512_castps_pd(u[2 * k + 1]);
    v[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  // lane l, element e: a[4e + l]'s 0 + 1; put it at 4l + e
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xdd));
  return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r)};
}
inline vf load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline vf load_f16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
#else
struct vf {
  __m256 lo, hi;
};
constexpr int kRegisters = 2;
constexpr int kVectorRegisters = 16;
inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, vf a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline vf operator+(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf operator-(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf operator*(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf operator/(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf max(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf min(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vf round(vf a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// a * 2^n for integral n in [-126, 127]: n becomes the exponent field of a float.
inline __m256 pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vf ldexp(vf a, vf n) { return {_mm256_mul_ps(a.lo, pow2(n.lo)), _mm256_mul_ps(a.hi, pow2(n.hi))}; }
inline float sum(vf a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
// sum16's steps, each usable as soon as its inputs are (group_scores folds the keys of a
// group as it goes: all 16 partial sums at once would take 32 of AVX2's 16 registers).
// 128-bit lane l: a's (l = 0) or b's (l = 1) (x_j + x_j+8) + (x_j+4 + x_j+12).
inline __m256 fold2(vf a, vf b) {
  const __m256 s0 = _mm256_add_ps(a.lo, a.hi), s1 = _mm256_add_ps(b.lo, b.hi);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}
// Of fold2(a0, a1) and fold2(a2, a3): lane l, j + j+2 of a_l, then of a_2+l.
inline __m256 fold4(__m256 u0, __m256 u1) {
  const __m256d p = _mm256_castps_pd(u0), q = _mm256_castps_pd(u1);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(p, q)), _mm256_castpd_ps(_mm256_unpackhi_pd(p, q)));
}
// Of the fold4s of a0..a3 and a4..a7: lane i, sum(a_i).
inline __m256 fold8(__m256 v0, __m256 v1) {
  const __m256i at = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // lane l, element e held a[2e + l]
  return _mm256_permutevar8x32_ps(_mm256_add_ps(_mm256_shuffle_ps(v0, v1, 0x88), _mm256_shuffle_ps(v0, v1, 0xdd)), at);
}
// Lane i: sum(part(i)) for i < 8, by the three steps above; part(i) is asked for when its
// pair is folded, so a caller can compute each vector as it is needed.
template <class Part>
__attribute__((always_inline)) inline __m256 fold_eight(const Part& part) {
  const __m256 v0 = fold4(fold2(part(0), part(1)), fold2(part(2), part(3)));
  return fold8(v0, fold4(fold2(part(4), part(5)), fold2(part(6), part(7))));
}
// Lane i of the result: sum(a[i]), added in sum()'s order, so the scores are the bits a
// sum per key gave.
__attribute__((always_inline)) inline vf sum16(const vf* a) {
  return {fold_eight([&](int j) { return a[j]; }), fold_eight([&](int j) { return a[8 + j]; })};
}
inline __m256 bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline vf load_bf16(const uint16_t* p) {
  return {bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline vf load_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
#endif

// exp(x) for the SiLU: 2^(x log2 e) by range reduction and a degree-6 polynomial
// (relative error ~2e-7, well below bfloat16's).
inline vf exp(vf x) {
  x = max(min(x, set1(88.0f)), set1(-88.0f));
  const vf y = x * set1(1.4426950408889634f);
  const vf n = round(y);
  const vf f = (y - n) * set1(0.6931471805599453f);  // in [-ln2/2, ln2/2]
  vf p = set1(1.0f / 720);
  p = fmadd(p, f, set1(1.0f / 120));
  p = fmadd(p, f, set1(1.0f / 24));
  p = fmadd(p, f, set1(1.0f / 6));
  p = fmadd(p, f, set1(0.5f));
  p = fmadd(p, f, set1(1.0f));
  p = fmadd(p, f, set1(1.0f));
  return ldexp(p, n);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, as torch does
  return static_cast<uint16_t>(u >> 16);
}

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bf16_to_f32(x); }

}  // namespace simd
