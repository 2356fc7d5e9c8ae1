// Stands in for torch's header in the kernel harness: a failed check aborts, naming itself.
#pragma once

#include <cstdio>
#include <cstdlib>

#define TORCH_CHECK(cond, ...)                                   \
  do {                                                           \
    if (!(cond)) {                                               \
      std::fprintf(stderr, "TORCH_CHECK failed: %s\n", #cond);   \
      std::abort();                                              \
    }                                                            \
  } while (0)
