#!/bin/bash
# One device call: the engine's CUDA test files, `tandem sim profile` on CUDA for a
# SmolLM2-shaped random model, `tandem bench engine` on CUDA. Everything lands in $OUT.
# usage: .gpu/run.sh [dry]   (dry: CPU, tiny shape, quick grid, for a check before the device)
set -u
export PYTHONUNBUFFERED=1
unset CI  # smollm2 tests skip (no GGUF here) instead of failing
cd "$(dirname "$0")/.."
DRY=${1:-}
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "=== $1 at +$(( $(date +%s) - T0 ))s"; }
if [ -z "$DRY" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
  DEV=cuda; TINY=; QUICK=; SEQS=256; BUDGET=8192; CONC=1,32,128; PLEN=1000
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
else
  export PYTHONPATH=$PWD
  DEV=cpu; TINY=--tiny; QUICK=--quick; SEQS=8; BUDGET=256; CONC=1,4; PLEN=100
fi
MODEL=/tmp/gpu-smol$DRY
# the branch's profiler (an evicted prefix is computed again); this copy of the tree only
[ -z "$DRY" ] && [ -d .gpu/patch/tree ] && cp -r .gpu/patch/tree/. .
stamp model
$PY .gpu/make_model.py $MODEL $TINY > /tmp/model.log 2>&1 || { cat /tmp/model.log; exit 1; }; tail -1 /tmp/model.log
$PY -c "import torch,sys; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"

stamp profile
timeout 240 $PY -m services.cli sim profile $QUICK --set model.path=$MODEL --set engine.device=$DEV \
  --set engine.quantization=int4 --set engine.block_size=64 --set engine.num_kv_blocks=1024 \
  --set engine.max_num_seqs=$SEQS --set engine.max_num_batched_tokens=$BUDGET \
  --out "$OUT/profile.yaml" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"; tail -8 "$OUT/profile.log"

stamp bench
if [ -z "${SKIP_BENCH:-}" ]; then
timeout 120 $PY -m services.cli bench engine --set model.path=$MODEL --set engine.device=$DEV \
  --set engine.quantization=int4 --concurrency $CONC --prompt-len $PLEN \
  --json "$OUT/bench_engine.json" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"; tail -8 "$OUT/bench.log"
fi

stamp tests
FILES="tests/unit/engine/runner/test_cuda_graphs.py tests/unit/engine/test_overlap.py
 tests/unit/engine/runner/test_torch_runner.py tests/unit/engine/test_model_vs_hf.py
 tests/unit/engine/grammar/test_grammar.py tests/unit/engine/multimodal/test_llava_engine.py
 tests/unit/engine/quant/test_quant_groups.py tests/unit/engine/tp/test_tp.py"
XDIST=; [ -z "$DRY" ] && XDIST="-n 8 --dist loadfile"
timeout ${TEST_S:-200} $PY -m pytest -q -rfEs -p no:randomly -p no:cacheprovider $XDIST --durations=10 \
  --junitxml="$OUT/tests.xml" $FILES > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -25 "$OUT/tests.log"
stamp done
