#!/bin/bash
# One device call on current main: every engine test file with a CUDA variant (random
# SmolLM2-shaped model), `bench engine` dense bf16 at 1/32/128 sequences, and json vs free
# decoding at 32 sequences (int4, overlap on).  usage: .gpu/run.sh [dry]
set -u
export PYTHONUNBUFFERED=1
unset CI
ROOT=$PWD
DRY=${1:-}
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "=== $1 at +$(( $(date +%s) - T0 ))s"; }
if [ -z "$DRY" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
  PY=python3; DEV=cuda; TINY=; STEPS=256; GSTEPS=512; CONC=1,32,128
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
else
  PY=$ROOT/.venv/bin/python; DEV=cpu; TINY=--tiny; STEPS=4; GSTEPS=8; CONC=1,4
fi
export PYTHONPATH=$ROOT:/tmp/site
(lscpu | grep -E "Model name|^CPU\(s\)|Flags"; uptime) >> "$OUT/gpu.txt"
$PY -c "import torch,triton,sys; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))" 2>&1 | tee -a "$OUT/gpu.txt"
git log -1 --format='%H %s' >> "$OUT/gpu.txt" 2>/dev/null
MODEL=/tmp/gpu-smol$DRY
stamp model
[ -d $MODEL ] || $PY .gpu/make_model.py $MODEL $TINY > /tmp/model.log 2>&1 || { cat /tmp/model.log; exit 1; }
stamp tests
FILES="tests/unit/engine/test_deterministic_cuda.py tests/unit/engine/runner/test_cuda_graphs.py
 tests/unit/engine/test_overlap.py tests/unit/engine/runner/test_torch_runner.py
 tests/unit/engine/test_model_vs_hf.py tests/unit/engine/grammar/test_grammar.py
 tests/unit/engine/multimodal/test_llava_engine.py tests/unit/engine/quant/test_quant_groups.py
 tests/unit/engine/tp/test_tp.py"
if [ -z "$DRY" ]; then
TANDEM_TEST_CUDA_MODEL=$MODEL timeout ${TEST_S:-210} $PY -m pytest -q -rfEs -p no:randomly -p no:cacheprovider \
  -n 8 --dist loadfile --durations=8 $FILES > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/tests.log" | tail -15
fi
stamp bench
B="bench engine -c $ROOT/configs/local.yaml --set model.path=$MODEL --set engine.device=$DEV --set engine.quantization=none --concurrency $CONC --decode-steps $STEPS --prompt-len 1000"
timeout ${BENCH_S:-100} $PY -m services.cli $B --json $OUT/bench_default.json > $OUT/bench.log 2>&1; echo "bench rc=$?"; tail -6 $OUT/bench.log
stamp grammar
G="bench engine -c $ROOT/configs/local.yaml --set model.path=$MODEL --set engine.device=$DEV --set engine.quantization=int4 --structured none,json --overlap on --concurrency 32 --decode-steps $GSTEPS --prompt-len 200"
timeout ${GRAMMAR_S:-100} $PY -m services.cli $G --json $OUT/grammar.json > $OUT/grammar.log 2>&1; echo "grammar rc=$?"; grep -E "^torch|json|none" $OUT/grammar.log | tail -6
stamp done
