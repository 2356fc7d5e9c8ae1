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

#include <algorithm>
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

// One head's products with key i of a group staged as float32 in kf (16 * VECS vectors a
// key), zero past the group's n keys: the partial sums that simd::sum16 (or, under AVX2,
// its steps) folds into the key's score.
template <int VECS>
inline vf key_products(const vf* qv, const float* kf, int64_t i, int64_t n, int64_t vecs) {
  if (i >= n) return simd::zero();
  const float* k = kf + i * vecs * 16;
  vf s = qv[0] * simd::load(k);
  for (int64_t v = 1; v < vecs; ++v) s = simd::fmadd(qv[v], simd::load(k + v * 16), s);
  return s;
}

// One head's scores of up to 16 keys as one vector, each summed in the order simd::sum
// gives one, whatever its place in the group.
#if defined(__AVX2__) && !defined(__AVX512F__)
// Under AVX2 the keys are folded in pairs as they are done (simd::fold_eight: the steps of
// sum16, the same bits): the 16 partial sums, held for one sum16, took 32 of its 16
// registers and went through the stack.
template <int VECS>
inline vf group_scores(const vf* qv, const float* kf, int64_t n, int64_t vecs) {
  return {simd::fold_eight([&](int64_t j) { return key_products<VECS>(qv, kf, j, n, vecs); }),
          simd::fold_eight([&](int64_t j) { return key_products<VECS>(qv, kf, 8 + j, n, vecs); })};
}
#else
template <int VECS>
inline vf group_scores(const vf* qv, const float* kf, int64_t n, int64_t vecs) {
  vf part[16];
  for (int64_t i = 0; i < 16; ++i) part[i] = key_products<VECS>(qv, kf, i, n, vecs);
  return simd::sum16(part);
}
#endif

// acc[j][v0, v0 + CV) += sum over the block's n tokens of p[j][t] * V[t] for NH heads of
// one KV head (vp: the block's first token of that head; p[j]: head j's softmax numerators
// at the block): the outputs stay in registers across the block, one load and store a block.
template <int NH, int CV>
inline void accumulate_slice(float* const* acc, const float* const* p, const uint16_t* vp, int64_t tok, int64_t n,
                             int64_t v0, int64_t cv) {
  vf o[NH][CV];
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t v = 0; v < cv; ++v) o[j][v] = simd::load(acc[j] + (v0 + v) * 16);
  for (int64_t i = 0; i < n; ++i, vp += tok) {
    vf x[CV];
    for (int64_t v = 0; v < cv; ++v) x[v] = simd::load_bf16(vp + (v0 + v) * 16);
    for (int64_t j = 0; j < NH; ++j) {
      const vf pj = simd::set1(p[j][i]);
      for (int64_t v = 0; v < cv; ++v) o[j][v] = simd::fmadd(pj, x[v], o[j][v]);
    }
  }
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t v = 0; v < cv; ++v) simd::store(acc[j] + (v0 + v) * 16, o[j][v]);
}

// Outputs a slice of accumulate_values takes: the most of VECS (halving) whose
// accumulators, one vf of values and a broadcast per head fit in the set's registers.
constexpr int slice_vecs(int nh, int vecs) {
  int c = vecs;
  while (c > 1 && (nh * c + 1) * simd::kRegisters + nh > simd::kVectorRegisters) c /= 2;
  return c < 1 ? 1 : c;
}

// accumulate_slice over the head's 16 * VECS outputs (VECS 0: vecs, read at run time);
// ``sliced`` (a run's rows, whose values are in L1): a slice at a time (slice_vecs). Under
// AVX2 three heads' 64 outputs alone would take 24 of its 16 registers, and a sum spilled
// to the stack makes every token wait on a store and its reload; a single row (decode),
// whose values come from memory, measured ~3% faster as one pass all the same. Each
// output's sum runs over the tokens in the same order whatever the slicing: the same bits.
template <int NH, int VECS>
inline void accumulate_values(float* const* acc, const float* const* p, const uint16_t* vp, int64_t tok,
                              int64_t n, int64_t vecs, bool sliced) {
  constexpr int CV = VECS == 0 ? 1 : slice_vecs(NH, VECS);
  if (CV == VECS || !sliced) {
    accumulate_slice<NH, VECS == 0 ? 16 : VECS>(acc, p, vp, tok, n, 0, vecs);
    return;
  }
  for (int64_t v0 = 0; v0 < vecs; v0 += CV) accumulate_slice<NH, CV>(acc, p, vp, tok, n, v0, CV);
}

constexpr int64_t kRunRows = 8;  // rows of one sequence a task attends together

// Rows of one sequence attended together: consecutive tokens of a prefill chunk, each
// row's context one token longer than the row before (lens ascending), all read through
// the same block table. Row i's query at q + i * q_stride, its output at out + i * out_stride.
struct RowRun {
  const float* q;
  int64_t q_stride;
  float* out;
  int64_t out_stride;
  const int64_t* lens;
  int64_t rows;
};

// The heads of ``r`` of a run's rows over their contexts, head_dim 16 * VECS (VECS 0:
// read at run time). Keys and values are walked block by block in token order, every KV
// head of the range at each block before the next: a block's bytes are read together, in
// order, where one pass per KV head would read a third of each token's bytes at a time
// (the prefetcher then loses most of the stream). The rows of a run share each group of
// keys staged as float32 (and each block of values while it is in L1): a prefill chunk
// converts its keys once, not once per row. A head's arithmetic on a row does not
// depend on the range or the run it is computed in, so neither does a row's output on
// the rows beside it (deterministic mode relies on that). scores: rows * r.heads() *
// lens[rows - 1] floats.
template <int VECS>
void attend_range(const RowRun& run, const uint16_t* kv, int64_t kv_half, const int64_t* blocks, const HeadRange& r,
                  const Dims& d, float* scores) {
  const int64_t hd = d.head_dim, vecs = VECS > 0 ? VECS : hd / 16, bs = d.block_size, tok = d.kv_heads * hd;
  const int64_t group = d.heads / d.kv_heads, ng = r.g_hi - r.g_lo, nk = r.heads();
  const int64_t len = run.lens[run.rows - 1];  // the longest context, the last row's
  const vf scale = simd::set1(1.0f / std::sqrt(static_cast<float>(hd)));
  // head k of the range: KV head r.kv_lo + k / ng, query head (that) * group + r.g_lo + k % ng
  const auto qhead = [&](int64_t k) { return (r.kv_lo + k / ng) * group + r.g_lo + k % ng; };
  // row i's scores of head k: len_i floats at row_scores(i) + k * len_i
  const auto row_scores = [&](int64_t i) { return scores + i * nk * len; };
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
      for (int64_t row = 0; row < run.rows; ++row) {
        const int64_t len_i = run.lens[row];
        if (len_i <= t0) continue;
        const int64_t n_i = std::min<int64_t>(16, len_i - t0);
        const float* q = run.q + row * run.q_stride;
        float* sc_row = row_scores(row);
        for (int64_t g = r.g_lo; g < r.g_hi; ++g) {
          const int64_t k = (kvh - r.kv_lo) * ng + g - r.g_lo;
          vf qv[VECS > 0 ? VECS : 16];
          for (int64_t v = 0; v < vecs; ++v) qv[v] = simd::load(q + qhead(k) * hd + v * 16) * scale;
          const vf sc = group_scores<VECS>(qv, kf, n_i, vecs);
          if (n_i == 16) {
            simd::store(sc_row + k * len_i + t0, sc);
          } else {
            simd::store(tail, sc);
            std::memcpy(sc_row + k * len_i + t0, tail, n_i * sizeof(float));
          }
        }
      }
    }
  }
  float inv[kRunRows * 256];  // run.rows <= kRunRows, nk <= 256
  for (int64_t row = 0; row < run.rows; ++row) {
    const int64_t len_i = run.lens[row];
    float* out = run.out + row * run.out_stride;
    for (int64_t k = 0; k < nk; ++k) {
      float* sk = row_scores(row) + k * len_i;
      vf m = simd::set1(-INFINITY);
      int64_t t = 0;
      for (; t + 16 <= len_i; t += 16) m = simd::max(m, simd::load(sk + t));
      simd::store(tail, m);
      float mx = tail[0];
      for (int64_t i = 1; i < 16; ++i) mx = std::max(mx, tail[i]);
      for (; t < len_i; ++t) mx = std::max(mx, sk[t]);
      inv[row * nk + k] = 1.0f / exp_shifted(sk, len_i, mx);
      std::memset(out + qhead(k) * hd, 0, hd * sizeof(float));
    }
  }
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
    const uint16_t* base = kv + kv_half + blocks[b] * bs * tok;
    for (int64_t kvh = r.kv_lo; kvh < r.kv_hi; ++kvh) {
      const uint16_t* vp = base + kvh * hd;
      for (int64_t row = 0; row < run.rows; ++row) {
        const int64_t len_i = run.lens[row];
        if (len_i <= t0) continue;
        const int64_t n = std::min(bs, len_i - t0);
        float* out = run.out + row * run.out_stride;
        for (int64_t g = r.g_lo; g < r.g_hi; g += kMaxFuse) {
          const int64_t nh = std::min(kMaxFuse, r.g_hi - g);
          float* acc[kMaxFuse];
          const float* p[kMaxFuse];
          for (int64_t j = 0; j < nh; ++j) {
            const int64_t k = (kvh - r.kv_lo) * ng + g - r.g_lo + j;
            acc[j] = out + qhead(k) * hd;
            p[j] = row_scores(row) + k * len_i + t0;
          }
          switch (nh) {
            case 1: accumulate_values<1, VECS>(acc, p, vp, tok, n, vecs, run.rows > 1); break;
            case 2: accumulate_values<2, VECS>(acc, p, vp, tok, n, vecs, run.rows > 1); break;
            case 3: accumulate_values<3, VECS>(acc, p, vp, tok, n, vecs, run.rows > 1); break;
            default: accumulate_values<kMaxFuse, VECS>(acc, p, vp, tok, n, vecs, run.rows > 1); break;
          }
        }
      }
    }
  }
  for (int64_t row = 0; row < run.rows; ++row) {
    float* out = run.out + row * run.out_stride;
    for (int64_t k = 0; k < nk; ++k) {
      const vf s = simd::set1(inv[row * nk + k]);
      float* o = out + qhead(k) * hd;
      for (int64_t v = 0; v < vecs; ++v) simd::store(o + v * 16, simd::load(o + v * 16) * s);
    }
  }
}

// attend_range at the head sizes it was compiled for (64 and 128, the common ones), else
// with head_dim read at run time.
void attend(const RowRun& run, const uint16_t* kv, int64_t kv_half, const int64_t* blocks, const HeadRange& r,
            const Dims& d, float* scores) {
  switch (d.head_dim) {
    case 64: return attend_range<4>(run, kv, kv_half, blocks, r, d, scores);
    case 128: return attend_range<8>(run, kv, kv_half, blocks, r, d, scores);
    default: return attend_range<0>(run, kv, kv_half, blocks, r, d, scores);
  }
}

// How decode_attention cuts its work into tasks: a whole run (every head), a run's KV head
// (its query heads), or one query head of one row (runs cut into single rows).
enum class Split { kWhole, kKvHead, kHead };

// When ``tasks`` (a callable taking a function of each task's cost, in task order) end on
// ``threads`` threads that each take the next task as they come free, as the pool hands
// them out.
template <class Tasks>
double finish(const Tasks& tasks, int64_t threads) {
  thread_local std::vector<double> free_at;
  free_at.assign(threads, 0.0);
  tasks([&](double cost) { *std::min_element(free_at.begin(), free_at.end()) += cost; });
  return *std::max_element(free_at.begin(), free_at.end());
}

// The split whose tasks should finish soonest on ``threads`` threads. A task's cost is
// estimated in units of one query head's products over one context token: staging a KV
// head's keys costs about one such unit a token (measured: one query head a task, each
// staging its own, ran a lone row's attention ~1.5x slower on one thread than one task of
// every head). Ties go to the coarser split, which reads each token's bytes together.
Split choose_split(const std::vector<int64_t>& starts, const int64_t* ctx, const Dims& d, int64_t threads) {
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1, group = d.heads / d.kv_heads;
  if (threads <= 1 || runs >= 2 * threads) return Split::kWhole;
  const auto run_kv = [&](int64_t i) {  // one KV head of run i
    return static_cast<double>(ctx[starts[i + 1] - 1]) * (1 + (starts[i + 1] - starts[i]) * group);
  };
  const double whole = finish([&](const auto& add) { for (int64_t i = 0; i < runs; ++i) add(d.kv_heads * run_kv(i)); },
                              threads);
  const double kv = finish([&](const auto& add) {
    for (int64_t i = 0; i < runs; ++i)
      for (int64_t h = 0; h < d.kv_heads; ++h) add(run_kv(i));
  }, threads);
  const double head = finish([&](const auto& add) {
    for (int64_t m = 0; m < starts[runs]; ++m)
      for (int64_t h = 0; h < d.heads; ++h) add(2.0 * ctx[m]);
  }, threads);
  if (whole <= kv && whole <= head) return Split::kWhole;
  return kv <= head ? Split::kKvHead : Split::kHead;
}

// Attention of one new token per row over its sequence's paged context; K/V bfloat16
// (2, blocks, block_size, kv_heads, hd), q float32 (rows, q_stride) with the heads first,
// out float32 (rows, heads, hd).
//
// Rows of one sequence at consecutive positions (a prefill chunk's tokens: the same
// block table, each context one longer) are cut into runs of up to kRunRows, and a task
// is a run: its keys are read once for all its rows. Every other row is a run of its own.
// With too few runs to keep every thread busy a task is one KV head of a run instead, or
// one query head of one row (choose_split): a lone sequence (SmolLM2: 3 KV heads of 3
// query heads) would leave threads idle. Each head's arithmetic is the same whatever the
// split, so a row's output does not depend on the rows beside it (deterministic mode
// relies on that).
void decode_attention(const float* q, int64_t q_stride, const uint16_t* kv, int64_t kv_half, const int64_t* table,
                      int64_t table_w, const int64_t* ctx, int64_t rows, const Dims& d, float* out) {
  const int64_t group = d.heads / d.kv_heads, hd = d.head_dim, bs = d.block_size;
  thread_local std::vector<int64_t> run_starts;
  // run r: rows [starts[r], starts[r + 1]); a local name, as the helpers must read the caller's
  std::vector<int64_t>& starts = run_starts;
  starts.clear();
  for (int64_t m = 0; m < rows; ++m) {
    const bool joins = m > 0 && m - starts.back() < kRunRows && ctx[m] == ctx[m - 1] + 1 &&
                       std::memcmp(table + m * table_w, table + (m - 1) * table_w,
                                   ((ctx[m] + bs - 1) / bs) * sizeof(int64_t)) == 0;
    if (!joins) starts.push_back(m);
  }
  starts.push_back(rows);
  const Split split = choose_split(starts, ctx, d, at::get_num_threads());
  if (split == Split::kHead) {  // one row a run
    starts.resize(rows + 1);
    for (int64_t m = 0; m <= rows; ++m) starts[m] = m;
  }
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  const int64_t per_run = split == Split::kWhole ? 1 : split == Split::kKvHead ? d.kv_heads : d.heads;
  const int64_t out_stride = d.heads * hd;
  parallel_for(runs * per_run, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / per_run, h = task % per_run;
      const int64_t m = starts[i], n = starts[i + 1] - m;
      const HeadRange r = split == Split::kWhole    ? HeadRange{0, d.kv_heads, 0, group}
                          : split == Split::kKvHead ? HeadRange{h, h + 1, 0, group}
                                                    : HeadRange{h / group, h / group + 1, h % group, h % group + 1};
      const int64_t need = n * r.heads() * ctx[m + n - 1];
      if (static_cast<int64_t>(scores.size()) < need) scores.resize(need);
      const RowRun run{q + m * q_stride, q_stride, out + m * out_stride, out_stride, ctx + m, n};
      attend(run, kv, kv_half, table + m * table_w, r, d, scores.data());
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

// f(begin, end) over rows [0, rows): on the pool in slices of kRowGrain rows where a step
// has more than one slice (a prefill chunk's rows), on the caller alone otherwise (a decode
// step, where waking the helper would cost more than the work).
constexpr int64_t kRowGrain = 32;
template <class F>
void each_rows(int64_t rows, const F& f) {
  parallel_for(rows, kRowGrain, f);
}

// x (rows, width) as a matmul reads it: itself where that is float32, else rounded into buf.
inline const float* matmul_input(const std::vector<float>& x, std::vector<float>&, int64_t, int64_t) { return x.data(); }
inline const uint16_t* matmul_input(const std::vector<float>& x, std::vector<uint16_t>& buf, int64_t rows,
                                    int64_t width) {
  each_rows(rows, [&](int64_t b, int64_t e) {
    for (int64_t i = b * width; i < e * width; ++i) buf[i] = f32_to_bf16(x[i]);
  });
  return buf.data();
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
  thread_local Scratch scratch;
  Scratch& s = scratch;  // a local name: the pool's helpers must see the caller's
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
    each_rows(rows, [&](int64_t b, int64_t e) {
      rms_norm(s.resid.data() + b * d.hidden, bf16(w[0]), e - b, d.hidden, eps, s.normed.data() + b * d.hidden);
    });
    const float* qkv_bias = w[3].numel() ? w[3].data_ptr<float>() : nullptr;
    int4_matmul(as_weight(w[1], w[2], qkv_w), s.normed.data(), rows, d.hidden, qkv_bias, s.qkv.data(), qkv_w);
    each_rows(rows, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m) {
        float* r = s.qkv.data() + m * qkv_w;
        rotary(r, d.heads + d.kv_heads, hd, cos_p + pos[m] * hd, sin_p + pos[m] * hd);
        uint16_t* k = kvp + slot[m] * kvw;
        to_bf16(r + qw, kvw, k);
        to_bf16(r + qw + kvw, kvw, k + kv_half);
      }
    });
    decode_attention(s.qkv.data(), qkv_w, kvp, kv_half, block_table.data_ptr<int64_t>(), block_table.size(1), ctx, rows,
                     d, s.attn.data());
    const Act* attn_in = matmul_input(s.attn, s.attn_in, rows, qw);
    int4_matmul(as_weight(w[4], w[5], d.hidden), attn_in, rows, qw, nullptr, s.proj.data(), d.hidden);
    // residual, then the MLP: norm, gate_up, silu(gate) * up, down, residual
    each_rows(rows, [&](int64_t b, int64_t e) {
      for (int64_t i = b * d.hidden; i < e * d.hidden; ++i) s.resid[i] += s.proj[i];
      rms_norm(s.resid.data() + b * d.hidden, bf16(w[6]), e - b, d.hidden, eps, s.normed.data() + b * d.hidden);
    });
    int4_matmul(as_weight(w[7], w[8], 2 * d.inter), s.normed.data(), rows, d.hidden, nullptr, s.gate_up.data(), 2 * d.inter);
    each_rows(rows, [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m) {
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
    });
    int4_matmul(as_weight(w[9], w[10], d.hidden), s.act.data(), rows, d.inter, nullptr, s.proj.data(), d.hidden);
    each_rows(rows, [&](int64_t b, int64_t e) {
      for (int64_t i = b * d.hidden; i < e * d.hidden; ++i) s.resid[i] += s.proj[i];
    });
  }
  at::Tensor out = at::empty({rows, d.hidden}, embed.options());
  uint16_t* outp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  each_rows(rows, [&](int64_t b, int64_t e) {
    rms_norm(s.resid.data() + b * d.hidden, bf16(final_norm), e - b, d.hidden, eps, outp + b * d.hidden);
  });
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
