"""Our AVX-512 CPU kernels (decode.cpp): int4 matmuls and the decode-only step."""
