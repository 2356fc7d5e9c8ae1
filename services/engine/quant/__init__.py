"""Weight-only quantization (``engine.quantization``): int4 groups from GGUF blocks or floats
(groups.py), the quantized matmuls and layer (linear.py), and applying them to a model
(apply.py). docs/engine.md "Dtype and quantized weights" has the why and the numbers."""
