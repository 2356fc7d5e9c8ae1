// CPU decode kernels: an int4 matmul and the whole decoder stack of a decode-only step in
// one call, compiled once per instruction set (build.py: -m flags and TANDEM_OPS, the op
// namespace) and loaded only where the CPU has that set.
//
// Why: at one sequence a decode step of a small model is dominated by per-op overhead
// (thousands of small eager ops) and by torch's int4 kernel, not by weight bytes
// (docs/engine.md, "CPU decode kernels"). Here one call runs every layer with the
// weights streamed once, the residual stream kept in float32 and no allocation after
// the first step.
//
// The matmul: matmul_bf16.h (AVX512-BF16: bfloat16 activations) or matmul_int8.h (every
// other set: int8 activations per 32-wide group). Weight layout: tiles of 16 output rows,
// one a vector lane (weight.h, quant/pack.py), w = scale * q + min with q in 0..15. A weight
// whose codes are wider than the input (input_repeat, Q8_0 as two nibble halves) reads
// the input cyclically.

#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include "matmul_bf16.h"
#else
#include "matmul_int8.h"
#endif
#include "pool.h"
#include "simd.h"
#include "weight.h"

#include <cmath>
#include <cstdint>
#include <vector>

#ifndef TANDEM_OPS
#error "build.py names the op namespace: -DTANDEM_OPS=tandem_cpu_<isa>"
#endif

namespace {

using simd::bf16_to_f32;
using simd::f32_to_bf16;
using simd::vf;

// What the matmuls inside the step read: bfloat16 for vdpbf16ps; float32 on the int8
// paths, which quantize it straight to int8 (no bfloat16 rounding before the int8 one).
#if defined(__AVX512BF16__)
using Act = uint16_t;
#else
using Act = float;
#endif

Int4Weight as_weight(const at::Tensor& codes, const at::Tensor& sm, int64_t n) {
  TORCH_CHECK(codes.dtype() == at::kByte && codes.dim() == 2 && codes.is_contiguous() && codes.size(1) % 256 == 0,
              "codes: contiguous uint8 (tiles, groups * 256)");
  const int64_t tiles = codes.size(0), groups = codes.size(1) / 256;
  TORCH_CHECK(sm.dtype() == at::kHalf && sm.is_contiguous() && sm.numel() == tiles * groups * 32,
              "scale/min: contiguous float16 (tiles, groups, 2, 16)");
  TORCH_CHECK(n > (tiles - 1) * 16 && n <= tiles * 16, "int4 weight: ", n, " rows do not fill ", tiles, " tiles");
  return {codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sm.data_ptr<at::Half>()), n, tiles, groups};
}

inline void put(float x, uint16_t* out) { *out = f32_to_bf16(x); }
inline void put(float x, float* out) { *out = x; }

// out = x / rms(x) * weight, per row of width h.
template <class T>
void rms_norm(const float* x, const uint16_t* weight, int64_t rows, int64_t h, double eps, T* out) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* r = x + m * h;
    double ss = 0;
    for (int64_t i = 0; i < h; ++i) ss += static_cast<double>(r[i]) * r[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / h + eps));
    for (int64_t i = 0; i < h; ++i) put(r[i] * inv * bf16_to_f32(weight[i]), out + m * h + i);
  }
}

struct Dims {
  int64_t hidden, heads, kv_heads, head_dim, inter, layers, block_size;
};

// A step's activations, kept across steps (resized, never shrunk): float32 where they
// are summed into, Act where they feed a matmul.
struct Scratch {
  std::vector<float> resid, qkv, attn, proj, gate_up;
  std::vector<Act> normed, attn_in, act;
  void size(int64_t rows, const Dims& d) {
    resid.resize(rows * d.hidden);
    qkv.resize(rows * (d.heads + 2 * d.kv_heads) * d.head_dim);
    attn.resize(rows * d.heads * d.head_dim);
    proj.resize(rows * d.hidden);
    gate_up.resize(rows * 2 * d.inter);
    normed.resize(rows * d.hidden);
    attn_in.resize(rows * d.heads * d.head_dim);
    act.resize(rows * d.inter);
  }
};

// Rotate q and k of one row in place (HF rotate_half; sin carries the sign of the first half).
void rotary(float* v, int64_t heads, int64_t hd, const float* cos, const float* sin) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x = v + h * hd;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] + b * sin[i];
      x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// Softmax numerators in place (exp(x - mx)) and their sum: 16 at a time with the
// kernels' exp, the tail with std::exp.
float exp_shifted(float* x, int64_t n, float mx) {
  const vf m = simd::set1(mx);
  vf acc = simd::zero();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const vf e = simd::exp(simd::load(x + t) - m);
    simd::store(x + t, e);
    acc = acc + e;
  }
  float total = simd::sum(acc);
  for (; t < n; ++t) total += (x[t] = std::exp(x[t] - mx));
  return total;
}

constexpr int64_t kMaxFuse = 4;  // query heads whose outputs stay in registers together

// What one task of decode_attention attends: of one row, KV heads [kv_lo, kv_hi) and of
// each, its query heads [g_lo, g_hi) (kvh * group + g).
struct HeadRange {
  int64_t kv_lo, kv_hi, g_lo, g_hi;
  int64_t heads() const { return (kv_hi - kv_lo) * (g_hi - g_lo); }
};

// One head's scores of up to 16 keys, staged as float32 in kf (16 * VECS vectors a key):
// 16 vectors of partial sums that simd::sum16 folds into one vector of 16 scores, each
// summed in the order simd::sum gives one, whatever its place in the group.
template <int VECS>
inline vf group_scores(const vf* qv, const float* kf, int64_t n, int64_t vecs) {
  vf part[16];
  for (int64_t i = 0; i < 16; ++i) {
    if (i >= n) {
      part[i] = simd::zero();
      continue;
    }
    const float* k = kf + i * vecs * 16;
    vf s = qv[0] * simd::load(k);
    for (int64_t v = 1; v < vecs; ++v) s = simd::fmadd(qv[v], simd::load(k + v * 16), s);
    part[i] = s;
  }
  return simd::sum16(part);
}

// acc[j] += sum over the block's n tokens of p[j][t] * V[t] for NH heads of one KV head
// (vp: the block's first token of that head; p[j]: head j's softmax numerators at the
// block): the outputs stay in registers across the block, one load and store a block.
template <int NH, int VECS>
inline void accumulate_values(float* const* acc, const float* const* p, const uint16_t* vp, int64_t tok,
                              int64_t n, int64_t vecs) {
  vf o[NH][VECS > 0 ? VECS : 16];
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t v = 0; v < vecs; ++v) o[j][v] = simd::load(acc[j] + v * 16);
  vf x[VECS > 0 ? VECS : 16];
  for (int64_t i = 0; i < n; ++i, vp += tok) {
    for (int64_t v = 0; v < vecs; ++v) x[v] = simd::load_bf16(vp + v * 16);
    for (int64_t j = 0; j < NH; ++j) {
      const vf pj = simd::set1(p[j][i]);
      for (int64_t v = 0; v < vecs; ++v) o[j][v] = simd::fmadd(pj, x[v], o[j][v]);
    }
  }
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t v = 0; v < vecs; ++v) simd::store(acc[j] + v * 16, o[j][v]);
}

// The heads of ``r`` of one row over its ``len`` tokens, head_dim 16 * VECS (VECS 0: read
// at run time). Keys and values are walked block by block in token order, every KV head
// of the range at each block before the next: a block's bytes are read together, in
// order, where one pass per KV head would read a third of each token's bytes at a time
// (the prefetcher then loses most of the stream). A head's arithmetic does not depend on
// the range it is computed in, so neither does a row's output on the rows beside it
// (deterministic mode relies on that). scores: r.heads() * len floats.
template <int VECS>
void attend_range(const float* q, const uint16_t* kv, int64_t kv_half, const int64_t* blocks, int64_t len,
                  const HeadRange& r, const Dims& d, float* scores, float* out) {
  const int64_t hd = d.head_dim, vecs = VECS > 0 ? VECS : hd / 16, bs = d.block_size, tok = d.kv_heads * hd;
  const int64_t group = d.heads / d.kv_heads, ng = r.g_hi - r.g_lo;
  const vf scale = simd::set1(1.0f / std::sqrt(static_cast<float>(hd)));
  // head k of the range: KV head r.kv_lo + k / ng, query head (that) * group + r.g_lo + k % ng
  const auto qhead = [&](int64_t k) { return (r.kv_lo + k / ng) * group + r.g_lo + k % ng; };
  const uint16_t* tp[16];  // the group's tokens (all KV heads)
  alignas(64) float kf[16 * 256];
  alignas(64) float tail[16];
  int64_t kb = 0, off = 0;  // the next key's block and place in it
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t i = 0; i < n; ++i) {
      tp[i] = kv + (blocks[kb] * bs + off) * tok;
      if (++off == bs) off = 0, ++kb;
    }
    for (int64_t kvh = r.kv_lo; kvh < r.kv_hi; ++kvh) {
      for (int64_t i = 0; i < n; ++i)
        for (int64_t v = 0; v < vecs; ++v) simd::store(kf + (i * vecs + v) * 16, simd::load_bf16(tp[i] + kvh * hd + v * 16));
      for (int64_t g = r.g_lo; g < r.g_hi; ++g) {
        const int64_t k = (kvh - r.kv_lo) * ng + g - r.g_lo;
        vf qv[VECS > 0 ? VECS : 16];
        for (int64_t v = 0; v < vecs; ++v) qv[v] = simd::load(q + qhead(k) * hd + v * 16) * scale;
        const vf sc = group_scores<VECS>(qv, kf, n, vecs);
        if (n == 16) {
          simd::store(scores + k * len + t0, sc);
        } else {
          simd::store(tail, sc);
          std::memcpy(scores + k * len + t0, tail, n * sizeof(float));
        }
      }
    }
  }
  const int64_t nk = r.heads();
  float inv[256];
  for (int64_t k = 0; k < nk; ++k) {
    const float* sk = scores + k * len;
    vf m = simd::set1(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) m = simd::max(m, simd::load(sk + t));
    simd::store(tail, m);
    float mx = tail[0];
    for (int64_t i = 1; i < 16; ++i) mx = std::max(mx, tail[i]);
    for (; t < len; ++t) mx = std::max(mx, sk[t]);
    inv[k] = 1.0f / exp_shifted(scores + k * len, len, mx);
    std::memset(out + qhead(k) * hd, 0, hd * sizeof(float));
  }
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
    const int64_t n = std::min(bs, len - t0);
    const uint16_t* base = kv + kv_half + blocks[b] * bs * tok;
    for (int64_t kvh = r.kv_lo; kvh < r.kv_hi; ++kvh) {
      for (int64_t g = r.g_lo; g < r.g_hi; g += kMaxFuse) {
        const int64_t nh = std::min(kMaxFuse, r.g_hi - g);
        float* acc[kMaxFuse];
        const float* p[kMaxFuse];
        for (int64_t j = 0; j < nh; ++j) {
          const int64_t k = (kvh - r.kv_lo) * ng + g - r.g_lo + j;
          acc[j] = out + qhead(k) * hd;
          p[j] = scores + k * len + t0;
        }
        const uint16_t* vp = base + kvh * hd;
        switch (nh) {
          case 1: accumulate_values<1, VECS>(acc, p, vp, tok, n, vecs); break;
          case 2: accumulate_values<2, VECS>(acc, p, vp, tok, n, vecs); break;
          case 3: accumulate_values<3, VECS>(acc, p, vp, tok, n, vecs); break;
          default: accumulate_values<kMaxFuse, VECS>(acc, p, vp, tok, n, vecs); break;
        }
      }
    }
  }
  for (int64_t k = 0; k < nk; ++k) {
    const vf s = simd::set1(inv[k]);
    float* o = out + qhead(k) * hd;
    for (int64_t v = 0; v < vecs; ++v) simd::store(o + v * 16, simd::load(o + v * 16) * s);
  }
}

// attend_range at the head sizes it was compiled for (64 and 128, the common ones), else
// with head_dim read at run time.
void attend(const float* q, const uint16_t* kv, int64_t kv_half, const int64_t* blocks, int64_t len,
            const HeadRange& r, const Dims& d, float* scores, float* out) {
  switch (d.head_dim) {
    case 64: return attend_range<4>(q, kv, kv_half, blocks, len, r, d, scores, out);
    case 128: return attend_range<8>(q, kv, kv_half, blocks, len, r, d, scores, out);
    default: return attend_range<0>(q, kv, kv_half, blocks, len, r, d, scores, out);
  }
}

// Attention of one new token per row over its sequence's paged context; K/V bfloat16
// (2, blocks, block_size, kv_heads, hd), q float32 (rows, q_stride) with the heads first,
// out float32 (rows, heads, hd).
//
// A task is a whole row: its tokens' bytes are read once, in order. With fewer rows than
// two a thread a task is one query head instead: a lone sequence (SmolLM2: 9 heads) would
// leave one of two threads idle. Each head's arithmetic is the same either way, so a
// row's output does not depend on the rows beside it (deterministic mode relies on that).
void decode_attention(const float* q, int64_t q_stride, const uint16_t* kv, int64_t kv_half, const int64_t* table,
                      int64_t table_w, const int64_t* ctx, int64_t rows, const Dims& d, float* out) {
  const int64_t group = d.heads / d.kv_heads, hd = d.head_dim;
  const bool whole = rows >= 2 * at::get_num_threads();
  const int64_t per_row = whole ? 1 : d.heads;
  parallel_for(rows * per_row, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / per_row, h = task % per_row;
      const HeadRange r = whole ? HeadRange{0, d.kv_heads, 0, group}
                                : HeadRange{h / group, h / group + 1, h % group, h % group + 1};
      const int64_t len = ctx[m];
      if (static_cast<int64_t>(scores.size()) < r.heads() * len) scores.resize(r.heads() * len);
      attend(q + m * q_stride, kv, kv_half, table + m * table_w, len, r, d, scores.data(), out + m * d.heads * hd);
    }
  });
}

void to_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

// x (M, K) -> x @ W.T (M, N) in x's dtype: bfloat16, or float32 where the matmul takes it.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sm, int64_t out_features) {
  const bool f32 = x.dtype() == at::kFloat;
  TORCH_CHECK((x.dtype() == at::kBFloat16 || (kFloatInput && f32)) && x.dim() == 2 && x.is_contiguous(),
              kFloatInput ? "x: contiguous bfloat16 or float32 (M, K)" : "x: contiguous bfloat16 (M, K)");
  const Int4Weight w = as_weight(codes, sm, out_features);
  const int64_t rows = x.size(0), kx = x.size(1);
  TORCH_CHECK(kx % kGroup == 0, "int4_linear: input width ", kx, " is not a multiple of ", kGroup);
  at::Tensor out = at::empty({rows, w.n}, x.options());
#if !defined(__AVX512BF16__)
  if (f32) {
    int4_matmul(w, x.data_ptr<float>(), rows, kx, nullptr, out.data_ptr<float>(), w.n);
    return out;
  }
#endif
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  thread_local std::vector<float> y;
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t block = kFloatInput ? 256 : 16;  // rows at a time: a float32 buffer that stays small
  y.resize(block * w.n);
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t r = std::min<int64_t>(block, rows - r0);
    int4_matmul(w, xp + r0 * kx, r, kx, nullptr, y.data(), w.n);
    to_bf16(y.data(), r * w.n, op + r0 * w.n);
  }
  return out;
}

// The decoder stack of a decode-only step: one token per row, one row per sequence.
// weights: 11 tensors a layer (input norm, qkv codes, qkv scale/min, qkv bias or empty,
// o codes, o scale/min, post-attention norm, gate_up codes, gate_up scale/min, down codes,
// down scale/min). Writes each token's K/V at its slot; returns the final-norm hidden (rows, H).
at::Tensor decode_forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slots,
                          const at::Tensor& block_table, const at::Tensor& ctx_lens, const at::Tensor& embed,
                          at::TensorList kv_caches, at::TensorList weights, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& final_norm, at::IntArrayRef dims, double eps) {
  TORCH_CHECK(dims.size() == 7, "dims: hidden, heads, kv_heads, head_dim, intermediate, layers, block_size");
  const Dims d{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6]};
  const int64_t rows = input_ids.size(0);
  TORCH_CHECK(rows >= 1, "decode_forward: no rows");
  TORCH_CHECK(d.head_dim % 16 == 0 && d.head_dim <= 256 && d.heads <= 256 && d.hidden % kGroup == 0 && d.inter % kGroup == 0, "decode_forward: unsupported dims");
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == d.layers && static_cast<int64_t>(weights.size()) == 11 * d.layers,
              "decode_forward: expected ", d.layers, " KV caches and ", 11 * d.layers, " weights");
  TORCH_CHECK(block_table.dtype() == at::kLong && block_table.is_contiguous() && block_table.size(0) == rows, "block_table");
  TORCH_CHECK(cos.dtype() == at::kFloat && sin.dtype() == at::kFloat, "cos/sin: float32");
  for (const at::Tensor* t : {&input_ids, &positions, &slots, &ctx_lens})
    TORCH_CHECK(t->dtype() == at::kLong && t->is_contiguous() && t->numel() == rows,
                "decode_forward: ids, positions, slots and context lengths: int64, one per row");
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* ctx = ctx_lens.data_ptr<int64_t>();
  const int64_t hd = d.head_dim, qw = d.heads * hd, kvw = d.kv_heads * hd, qkv_w = qw + 2 * kvw;
  const int64_t vocab = embed.size(0);
  for (int64_t m = 0; m < rows; ++m) {
    TORCH_CHECK(ids[m] >= 0 && ids[m] < vocab, "decode_forward: token id ", ids[m], " out of range");
    TORCH_CHECK(pos[m] >= 0 && pos[m] < cos.size(0), "decode_forward: position ", pos[m], " past the rotary table");
    TORCH_CHECK(ctx[m] == pos[m] + 1 && ctx[m] <= block_table.size(1) * d.block_size,
                "decode_forward: context ", ctx[m], " does not fit position ", pos[m], " and its block table");
  }
  thread_local Scratch s;
  s.size(rows, d);
  const uint16_t* emb = reinterpret_cast<const uint16_t*>(embed.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < d.hidden; ++i) s.resid[m * d.hidden + i] = bf16_to_f32(emb[ids[m] * d.hidden + i]);
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  auto bf16 = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  for (int64_t l = 0; l < d.layers; ++l) {
    const at::Tensor* w = weights.data() + 11 * l;
    const at::Tensor& kv = kv_caches[l];
    TORCH_CHECK(kv.is_contiguous() && kv.dtype() == at::kBFloat16 && kv.size(-1) == hd && kv.size(-2) == d.kv_heads,
                "decode_forward: KV cache: contiguous bfloat16 (2, blocks, block_size, kv_heads, head_dim)");
    uint16_t* kvp = reinterpret_cast<uint16_t*>(kv.data_ptr<at::BFloat16>());
    const int64_t kv_half = kv.numel() / 2;
    // attention: norm, qkv, rotary, K/V into the cache, attend, o_proj, residual
    rms_norm(s.resid.data(), bf16(w[0]), rows, d.hidden, eps, s.normed.data());
    const float* qkv_bias = w[3].numel() ? w[3].data_ptr<float>() : nullptr;
    int4_matmul(as_weight(w[1], w[2], qkv_w), s.normed.data(), rows, d.hidden, qkv_bias, s.qkv.data(), qkv_w);
    for (int64_t m = 0; m < rows; ++m) {
      float* r = s.qkv.data() + m * qkv_w;
      rotary(r, d.heads + d.kv_heads, hd, cos_p + pos[m] * hd, sin_p + pos[m] * hd);
      uint16_t* k = kvp + slot[m] * kvw;
      to_bf16(r + qw, kvw, k);
      to_bf16(r + qw + kvw, kvw, k + kv_half);
    }
    decode_attention(s.qkv.data(), qkv_w, kvp, kv_half, block_table.data_ptr<int64_t>(), block_table.size(1), ctx, rows,
                     d, s.attn.data());
    for (int64_t i = 0; i < rows * qw; ++i) put(s.attn[i], s.attn_in.data() + i);
    int4_matmul(as_weight(w[4], w[5], d.hidden), s.attn_in.data(), rows, qw, nullptr, s.proj.data(), d.hidden);
    for (int64_t i = 0; i < rows * d.hidden; ++i) s.resid[i] += s.proj[i];
    // MLP: norm, gate_up, silu(gate) * up, down, residual
    rms_norm(s.resid.data(), bf16(w[6]), rows, d.hidden, eps, s.normed.data());
    int4_matmul(as_weight(w[7], w[8], 2 * d.inter), s.normed.data(), rows, d.hidden, nullptr, s.gate_up.data(), 2 * d.inter);
    for (int64_t m = 0; m < rows; ++m) {
      const float* g = s.gate_up.data() + m * 2 * d.inter;
      const float* u = g + d.inter;
      Act* o = s.act.data() + m * d.inter;
      for (int64_t i = 0; i < d.inter; i += 16) {
        const vf gv = simd::load(g + i);
        const vf silu = gv / (simd::set1(1.0f) + simd::exp(simd::zero() - gv));
        float tmp[16];
        simd::store(tmp, silu * simd::load(u + i));
        for (int j = 0; j < 16; ++j) put(tmp[j], o + i + j);
      }
    }
    int4_matmul(as_weight(w[9], w[10], d.hidden), s.act.data(), rows, d.inter, nullptr, s.proj.data(), d.hidden);
    for (int64_t i = 0; i < rows * d.hidden; ++i) s.resid[i] += s.proj[i];
  }
  at::Tensor out = at::empty({rows, d.hidden}, embed.options());
  rms_norm(s.resid.data(), bf16(final_norm), rows, d.hidden, eps, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

}  // namespace

TORCH_LIBRARY(TANDEM_OPS, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale_min, int out_features) -> Tensor");
  m.def("decode_forward(Tensor input_ids, Tensor positions, Tensor slots, Tensor block_table, Tensor ctx_lens, "
        "Tensor embed, Tensor[] kv_caches, Tensor[] weights, Tensor cos, Tensor sin, Tensor final_norm, "
        "int[] dims, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(TANDEM_OPS, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("decode_forward", &decode_forward);
}
