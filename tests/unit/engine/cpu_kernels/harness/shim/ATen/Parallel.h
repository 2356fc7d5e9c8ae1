// Stands in for torch's header in the kernel harness: the pool's size.
#pragma once

#include <cstdlib>

namespace at {
inline int get_num_threads() {
  const char* n = std::getenv("HARNESS_THREADS");
  return n ? std::atoi(n) : 2;
}
}  // namespace at
