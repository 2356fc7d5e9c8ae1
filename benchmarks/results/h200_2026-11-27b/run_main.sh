#!/bin/bash
# One device call: every engine test file with a CUDA variant (the deterministic mode's on a
# SmolLM2-shaped random model), then `tandem bench engine` on CUDA, dense bfloat16, the
# same command as the 2026-11-27 H200 runs. Everything lands in $OUT.
set -u
export PYTHONUNBUFFERED=1
unset CI  # smollm2 tests skip (no GGUF travels: 98 MB) instead of failing
ROOT=$PWD
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "=== $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=$ROOT:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
(lscpu | grep -E "Model name|^CPU\(s\)|Flags"; uptime) >> "$OUT/gpu.txt"
python3 -c "import torch,triton,sys; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"
git log -1 --format='%H %s' >> "$OUT/gpu.txt" 2>/dev/null
MODEL=/tmp/gpu-smol
stamp model
[ -d $MODEL ] || python3 .gpu/make_model.py $MODEL > /tmp/model.log 2>&1 || { cat /tmp/model.log; exit 1; }
stamp tests
FILES="tests/unit/engine/test_deterministic_cuda.py tests/unit/engine/runner/test_cuda_graphs.py
 tests/unit/engine/test_overlap.py tests/unit/engine/runner/test_torch_runner.py
 tests/unit/engine/test_model_vs_hf.py tests/unit/engine/grammar/test_grammar.py
 tests/unit/engine/multimodal/test_llava_engine.py tests/unit/engine/quant/test_quant_groups.py
 tests/unit/engine/tp/test_tp.py"
TANDEM_TEST_CUDA_MODEL=$MODEL timeout ${TEST_S:-240} python3 -m pytest -q -rfEs -p no:randomly -p no:cacheprovider \
  -n 8 --dist loadfile --durations=8 $FILES > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/tests.log" | tail -15
stamp bench
B="bench engine -c $ROOT/configs/local.yaml --set model.path=$MODEL --set engine.device=cuda --set engine.quantization=none --concurrency 1,32,128 --decode-steps 256 --prompt-len 1000"
timeout ${BENCH_S:-120} python3 -m services.cli $B --json $OUT/bench_default.json > $OUT/bench.log 2>&1; echo "bench rc=$?"; grep -E "tok/s|prefill|decode" $OUT/bench.log | tail -8
stamp done
