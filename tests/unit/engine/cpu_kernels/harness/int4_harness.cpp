// The int8-path kernels (matmul_int8.h, simd.h) without torch: one build per instruction
// set, so a set this machine cannot run natively (NEON, built by a cross compiler and run
// under qemu-user) gets the same checks as the native ones. test_kernel_harness.py writes
// the inputs and checks the outputs.
//
//   int4_harness matmul IN OUT   IN: int64 rows, kx, n, tiles, groups, bf16, bias; x (rows, kx)
//                                float32 or bfloat16 bits; codes; scale/min float16 bits;
//                                bias (n) float32 when set. OUT: y (rows, n) float32.
//   int4_harness simd IN OUT     IN: int64 count (a multiple of 16); x, y float32; h float16
//                                bits. OUT: float32 rows exp(x), round(x), x / y, max(x, y),
//                                min(x, y), x * y + x, load_f16(h), load_bf16(bf16(x)), and
//                                sum(x) per 16.
#include "matmul_int8.h"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace {

template <class T>
std::vector<T> take(std::istream& in, int64_t n) {
  std::vector<T> v(n);
  in.read(reinterpret_cast<char*>(v.data()), n * sizeof(T));
  if (!in) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
  return v;
}

template <class T>
void put(std::ostream& out, const std::vector<T>& v) {
  out.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

void matmul(std::istream& in, std::ostream& out) {
  const std::vector<int64_t> h = take<int64_t>(in, 7);
  const int64_t rows = h[0], kx = h[1], n = h[2], tiles = h[3], groups = h[4];
  const bool bf16 = h[5] != 0, has_bias = h[6] != 0;
  std::vector<float> xf;
  std::vector<uint16_t> xb;
  if (bf16) xb = take<uint16_t>(in, rows * kx);
  else xf = take<float>(in, rows * kx);
  const std::vector<uint8_t> codes = take<uint8_t>(in, tiles * groups * 256);
  const std::vector<uint16_t> sm = take<uint16_t>(in, tiles * groups * 32);
  const std::vector<float> bias = has_bias ? take<float>(in, n) : std::vector<float>();
  const Int4Weight w{codes.data(), sm.data(), n, tiles, groups};
  std::vector<float> y(rows * n);
  const float* b = has_bias ? bias.data() : nullptr;
  if (bf16) int4_matmul(w, xb.data(), rows, kx, b, y.data(), n);
  else int4_matmul(w, xf.data(), rows, kx, b, y.data(), n);
  put(out, y);
}

void simd_ops(std::istream& in, std::ostream& out) {
  const int64_t count = take<int64_t>(in, 1)[0];
  const std::vector<float> x = take<float>(in, count), y = take<float>(in, count);
  const std::vector<uint16_t> h = take<uint16_t>(in, count);
  std::vector<float> r(9 * count + count / 16 + count / 16);
  for (int64_t i = 0; i < count; i += 256) {  // sum16 of each 16 vectors
    simd::vf v[16];
    for (int k = 0; k < 16; ++k) v[k] = simd::load(&x[i + 16 * k]);
    simd::store(&r[9 * count + count / 16 + i / 16], simd::sum16(v));
  }
  for (int64_t i = 0; i < count; i += 16) {
    const simd::vf a = simd::load(&x[i]), b = simd::load(&y[i]);
    simd::store(&r[i], simd::exp(a));
    simd::store(&r[count + i], simd::round(a));
    simd::store(&r[2 * count + i], a / b);
    simd::store(&r[3 * count + i], simd::max(a, b));
    simd::store(&r[4 * count + i], simd::min(a, b));
    simd::store(&r[5 * count + i], simd::fmadd(a, b, a));
    simd::store(&r[6 * count + i], simd::load_f16(&h[i]));
    uint16_t xb[16];
    for (int k = 0; k < 16; ++k) xb[k] = simd::f32_to_bf16(x[i + k]);
    simd::store(&r[7 * count + i], simd::load_bf16(xb));
    simd::store(&r[8 * count + i], simd::ldexp(simd::set1(1.0f), simd::round(a)));
    r[9 * count + i / 16] = simd::sum(a);
  }
  put(out, r);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: int4_harness matmul|simd IN OUT\n");
    return 2;
  }
  std::ifstream in(argv[2], std::ios::binary);
  std::ofstream out(argv[3], std::ios::binary);
  const std::string mode = argv[1];
  if (mode == "matmul") matmul(in, out);
  else if (mode == "simd") simd_ops(in, out);
  else return 2;
  return 0;
}
