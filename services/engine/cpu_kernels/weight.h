// An int4 weight in quant/pack.py's layout, as the matmul kernels read it (torch-free: the
// kernel headers build into a test harness without torch, tests/unit/engine/cpu_kernels).
#pragma once

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

}  // namespace
