// An int4 weight in quant/pack.py's layout, as the matmul kernels read it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace {

constexpr int64_t kGroup = 32;

// Tiles of 16 output rows; per tile and 32-wide input group 256 bytes of codes (their
// order is the ISA's layout: quant/pack.py) and, in the scale/min tensor, 16 float16 scales and
// 16 float16 mins (w = scale * q + min, q in 0..15).
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

}  // namespace
