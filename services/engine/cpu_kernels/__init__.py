"""Our CPU kernels (decode.cpp, one build per instruction set: isa.py): int4 matmuls and the decode-only step."""
