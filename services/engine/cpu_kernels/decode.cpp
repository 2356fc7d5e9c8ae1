// CPU decode kernels for AVX-512 (BF16) machines: an int4 GEMV over bfloat16 activations
// and the whole decoder stack of a decode-only step in one call.
//
// Why: at one sequence a decode step of a small model is dominated by per-op overhead
// (thousands of small eager ops) and by torch's int4 kernel, not by weight bytes
// (docs/engine.md, "CPU decode kernels"). Here one call runs every layer with the
// weights streamed once, the residual stream kept in float32 and no allocation after
// the first step.
//
// Weight layout: tiles of 16 output rows, one a vector lane (see Int4Weight and
// cpu_kernels/pack.py), w = scale * q + min with q in 0..15. A weight whose codes are
// wider than the input (input_repeat, Q8_0 as two nibble halves) reads the input
// cyclically.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>  // at::get_num_threads: the pool's size
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// A pool of helper threads for the step's small parallel loops, in place of OpenMP's.
// The caller never waits for a helper that has not started: the caller claims tasks from
// the front of a loop, helpers from the back (each side streams through memory in
// order), and a loop ends when every task is done, whoever ran it. On a machine whose
// cores the cluster's other processes share, a helper descheduled between loops costs
// nothing but its share of the work, where an OpenMP barrier would hold every one of a
// step's ~150 loops for it. Helpers spin briefly between loops, then sleep.
class Pool {
 public:
  using Fn = void (*)(const void*, int64_t);

  static Pool& get() {
    static Pool* pool = new Pool(std::max(1, at::get_num_threads()) - 1);  // never destroyed: helpers outlive exit
    return *pool;
  }

  // fn(ctx, i) for every i in [0, n). Serial where another thread holds the pool.
  void run(int64_t n, Fn fn, const void* ctx) {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (helpers_ == 0 || n <= 1 || !lock.owns_lock()) {
      for (int64_t i = 0; i < n; ++i) fn(ctx, i);
      return;
    }
    TORCH_CHECK(n < (1 << 24), "pool: too many tasks");
    const uint64_t gen = ((ticket_.load(std::memory_order_relaxed) >> 48) + 1) & 0xffff;
    Job& job = jobs_[gen & 1];
    job.fn.store(fn, std::memory_order_relaxed);
    job.ctx.store(ctx, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    ticket_.store(gen << 48 | static_cast<uint64_t>(n), std::memory_order_release);  // front 0, back n
    if (sleepers_.load(std::memory_order_acquire) > 0) ticket_.notify_all();
    work(true);
    while (done_.load(std::memory_order_acquire) < n) _mm_pause();
  }

 private:
  struct Job {
    std::atomic<Fn> fn{nullptr};
    std::atomic<const void*> ctx{nullptr};
  };

  explicit Pool(int helpers) : helpers_(helpers) {
    for (int i = 0; i < helpers; ++i) std::thread([this] { loop(); }).detach();
  }

  // Claim (from the front or the back) and run tasks of the current loop until none are left.
  void work(bool front) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t lo = (t >> 24) & 0xffffff, hi = t & 0xffffff;
      if (lo >= hi) return;
      const uint64_t claimed = front ? t + (uint64_t{1} << 24) : t - 1;
      if (!ticket_.compare_exchange_weak(t, claimed, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      // The claim succeeded while this loop was current: its job slot is stable until done.
      const Job& job = jobs_[(t >> 48) & 1];
      job.fn.load(std::memory_order_relaxed)(job.ctx.load(std::memory_order_relaxed),
                                             static_cast<int64_t>(front ? lo : hi - 1));
      done_.fetch_add(1, std::memory_order_acq_rel);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void loop() {
    using clock = std::chrono::steady_clock;
    uint64_t seen = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const auto spin_until = clock::now() + std::chrono::microseconds(200);
      int polls = 0;
      while (ticket_.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        if (++polls % 256 == 0 && clock::now() > spin_until) {
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          ticket_.wait(seen, std::memory_order_acquire);
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      work(false);
      seen = ticket_.load(std::memory_order_acquire);
    }
  }

  const int helpers_;
  std::mutex mu_;
  Job jobs_[2];
  // generation (16 bits) | front: next task from the front (24) | back: one past the last unclaimed (24)
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
};

// parallel_for over [0, n) in chunks of grain, on the pool.
template <class F>
void parallel_for(int64_t n, int64_t grain, const F& f) {
  const int64_t chunks = (n + grain - 1) / grain;
  struct Ctx {
    const F* f;
    int64_t n, grain;
  } ctx{&f, n, grain};
  Pool::get().run(chunks, [](const void* c, int64_t i) {
    const Ctx& x = *static_cast<const Ctx*>(c);
    (*x.f)(i * x.grain, std::min(x.n, (i + 1) * x.grain));
  }, &ctx);
}

constexpr int64_t kGroup = 32;

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

inline __m512 load_bf16x16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

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

// exp(x) for the SiLU: 2^(x log2 e) by range reduction and a degree-6 polynomial
// (relative error ~2e-7, well below bfloat16's).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.6931471805599453f));  // in [-ln2/2, ln2/2]
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// An int4 weight in pack.py's layout: tiles of 16 output rows; per tile and 32-wide input
// group, 16 x 16 bytes of codes (pair p: byte i holds row i's inputs 2p, 2p + 1) and then,
// in the scale/min tensor, 16 float16 scales and 16 float16 mins (w = scale * q + min).
struct Int4Weight {
  const uint8_t* codes;  // (tiles, groups * 256)
  const uint16_t* sm;    // (tiles, groups, 2, 16) float16
  int64_t n, tiles, groups;
};

Int4Weight as_weight(const at::Tensor& codes, const at::Tensor& sm, int64_t n) {
  TORCH_CHECK(codes.dtype() == at::kByte && codes.dim() == 2 && codes.is_contiguous() && codes.size(1) % 256 == 0,
              "codes: contiguous uint8 (tiles, groups * 256)");
  const int64_t tiles = codes.size(0), groups = codes.size(1) / 256;
  TORCH_CHECK(sm.dtype() == at::kHalf && sm.is_contiguous() && sm.numel() == tiles * groups * 32,
              "scale/min: contiguous float16 (tiles, groups, 2, 16)");
  TORCH_CHECK(n > (tiles - 1) * 16 && n <= tiles * 16, "int4 weight: ", n, " rows do not fill ", tiles, " tiles");
  return {codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sm.data_ptr<at::Half>()), n, tiles, groups};
}

inline __m512 load_f16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
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

template <int MB>
void gemv_rows(const Int4Weight& w, const uint16_t* x, int64_t kx, const float* gsum, const float* bias,
               float* y, int64_t ldy) {
  const __m512i table = code_table();
  parallel_for(w.tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) gemv_tile<MB>(w, t, x, kx, gsum, bias, y, ldy, table);
  });
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
// (rows, ldy), in blocks of 4 rows (one unpack of the codes feeds every row of a block).
// The group sums go into a buffer kept across calls.
void int4_matmul(const Int4Weight& w, const uint16_t* x, int64_t rows, int64_t kx, const float* bias, float* y,
                 int64_t ldy) {
  TORCH_CHECK((w.groups * kGroup) % kx == 0, "int4 weight: ", w.groups * kGroup, " inputs do not repeat an input of ", kx);
  thread_local std::vector<float> gsum;
  gsum.resize(rows * w.groups);
  group_sums(x, rows, kx, w.groups, gsum.data());
  const float* gs = gsum.data();
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) gemv_rows<4>(w, x + m * kx, kx, gs + m * w.groups, bias, y + m * ldy, ldy);
  for (; m + 2 <= rows; m += 2) gemv_rows<2>(w, x + m * kx, kx, gs + m * w.groups, bias, y + m * ldy, ldy);
  for (; m < rows; ++m) gemv_rows<1>(w, x + m * kx, kx, gs + m * w.groups, bias, y + m * ldy, ldy);
}

// out (bf16) = x / rms(x) * weight, per row of width h.
void rms_norm(const float* x, const uint16_t* weight, int64_t rows, int64_t h, double eps, uint16_t* out) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* r = x + m * h;
    double ss = 0;
    for (int64_t i = 0; i < h; ++i) ss += static_cast<double>(r[i]) * r[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / h + eps));
    for (int64_t i = 0; i < h; ++i) out[m * h + i] = f32_to_bf16(r[i] * inv * bf16_to_f32(weight[i]));
  }
}

struct Dims {
  int64_t hidden, heads, kv_heads, head_dim, inter, layers, block_size;
};

// A step's activations, kept across steps (resized, never shrunk): float32 where they
// are summed into, bfloat16 where they feed a matmul.
struct Scratch {
  std::vector<float> resid, qkv, attn, proj, gate_up;
  std::vector<uint16_t> normed, attn_bf16, act;
  void size(int64_t rows, const Dims& d) {
    resid.resize(rows * d.hidden);
    qkv.resize(rows * (d.heads + 2 * d.kv_heads) * d.head_dim);
    attn.resize(rows * d.heads * d.head_dim);
    proj.resize(rows * d.hidden);
    gate_up.resize(rows * 2 * d.inter);
    normed.resize(rows * d.hidden);
    attn_bf16.resize(rows * d.heads * d.head_dim);
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

// Attention of one new token per row over its sequence's paged context; K/V bfloat16
// (2, blocks, block_size, kv_heads, hd), q float32 (rows, q_stride) with the heads first,
// out float32 (rows, heads, hd). One task a
// query head: a few KV heads alone would leave one of two threads idle a third of the time.
void decode_attention(const float* q, int64_t q_stride, const uint16_t* kv, int64_t kv_half, const int64_t* table,
                      int64_t table_w, const int64_t* ctx, int64_t rows, const Dims& d, float* out) {
  const int64_t group = d.heads / d.kv_heads, hd = d.head_dim, vecs = hd / 16;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  parallel_for(rows * d.heads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / d.heads, h = task % d.heads, kvh = h / group, len = ctx[m];
      const int64_t* blocks = table + m * table_w;
      scores.resize(len);
      __m512 qv[16];
      for (int64_t v = 0; v < vecs; ++v) qv[v] = _mm512_mul_ps(_mm512_loadu_ps(q + m * q_stride + h * hd + v * 16), _mm512_set1_ps(scale));
      float mx = -INFINITY;
      for (int64_t t = 0; t < len; ++t) {
        const uint16_t* k = kv + ((blocks[t / d.block_size] * d.block_size + t % d.block_size) * d.kv_heads + kvh) * hd;
        __m512 s = _mm512_mul_ps(qv[0], load_bf16x16(k));
        for (int64_t v = 1; v < vecs; ++v) s = _mm512_fmadd_ps(qv[v], load_bf16x16(k + v * 16), s);
        const float sc = _mm512_reduce_add_ps(s);
        scores[t] = sc;
        mx = std::max(mx, sc);
      }
      float total = 0;
      for (int64_t t = 0; t < len; ++t) total += (scores[t] = std::exp(scores[t] - mx));
      __m512 o[16];
      for (int64_t v = 0; v < vecs; ++v) o[v] = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        const uint16_t* vv = kv + kv_half + ((blocks[t / d.block_size] * d.block_size + t % d.block_size) * d.kv_heads + kvh) * hd;
        const __m512 p = _mm512_set1_ps(scores[t]);
        for (int64_t v = 0; v < vecs; ++v) o[v] = _mm512_fmadd_ps(p, load_bf16x16(vv + v * 16), o[v]);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / total);
      float* om = out + (m * d.heads + h) * hd;
      for (int64_t v = 0; v < vecs; ++v) _mm512_storeu_ps(om + v * 16, _mm512_mul_ps(o[v], inv));
    }
  });
}

void to_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sm, int64_t out_features) {
  TORCH_CHECK(x.dtype() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bfloat16 (M, K)");
  const Int4Weight w = as_weight(codes, sm, out_features);
  const int64_t rows = x.size(0), kx = x.size(1);
  TORCH_CHECK(kx % kGroup == 0, "int4_linear: input width ", kx, " is not a multiple of ", kGroup);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  thread_local std::vector<float> y;
  y.resize(16 * w.n);
  at::Tensor out = at::empty({rows, w.n}, x.options());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {  // 16 rows at a time: a small float32 buffer
    const int64_t r = std::min<int64_t>(16, rows - r0);
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
  TORCH_CHECK(d.head_dim % 16 == 0 && d.head_dim <= 256 && d.hidden % kGroup == 0 && d.inter % kGroup == 0, "decode_forward: unsupported dims");
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
    to_bf16(s.attn.data(), rows * qw, s.attn_bf16.data());
    int4_matmul(as_weight(w[4], w[5], d.hidden), s.attn_bf16.data(), rows, qw, nullptr, s.proj.data(), d.hidden);
    for (int64_t i = 0; i < rows * d.hidden; ++i) s.resid[i] += s.proj[i];
    // MLP: norm, gate_up, silu(gate) * up, down, residual
    rms_norm(s.resid.data(), bf16(w[6]), rows, d.hidden, eps, s.normed.data());
    int4_matmul(as_weight(w[7], w[8], 2 * d.inter), s.normed.data(), rows, d.hidden, nullptr, s.gate_up.data(), 2 * d.inter);
    for (int64_t m = 0; m < rows; ++m) {
      const float* g = s.gate_up.data() + m * 2 * d.inter;
      const float* u = g + d.inter;
      uint16_t* o = s.act.data() + m * d.inter;
      for (int64_t i = 0; i < d.inter; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
        to_bf16(tmp, 16, o + i);
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

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale_min, int out_features) -> Tensor");
  m.def("decode_forward(Tensor input_ids, Tensor positions, Tensor slots, Tensor block_table, Tensor ctx_lens, "
        "Tensor embed, Tensor[] kv_caches, Tensor[] weights, Tensor cos, Tensor sin, Tensor final_norm, "
        "int[] dims, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("decode_forward", &decode_forward);
}
