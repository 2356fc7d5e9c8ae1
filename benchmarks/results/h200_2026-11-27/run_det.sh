#!/bin/bash
# One device call: engine.deterministic on CUDA (batch-invariant Triton kernels): its tests,
# bench engine of the mode against the dense default, then the engine's other CUDA tests.
set -u
export PYTHONUNBUFFERED=1
unset CI
ROOT=$PWD
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "=== $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=$ROOT:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
(lscpu | grep -E "Model name|^CPU\(s\)|Flags"; uptime) >> "$OUT/gpu.txt"
python3 -c "import torch,triton,sys; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"
MODEL=/tmp/gpu-smol
stamp model
[ -d $MODEL ] || python3 .gpu/make_model.py $MODEL > /tmp/model.log 2>&1 || { cat /tmp/model.log; exit 1; }
stamp det-tests
TANDEM_TEST_CUDA_MODEL=$MODEL timeout ${DET_S:-240} python3 -m pytest -q -rfE -p no:randomly -p no:cacheprovider \
  tests/unit/engine/test_deterministic_cuda.py > "$OUT/det_tests.log" 2>&1; echo "det tests rc=$?"; tail -25 "$OUT/det_tests.log"
[ -n "${SKIP_BENCH:-}" ] || {
B="bench engine -c $ROOT/configs/local.yaml --set model.path=$MODEL --set engine.device=cuda --set engine.quantization=none --concurrency 1,32,128 --decode-steps 256 --prompt-len 1000"
for v in ${VARIANTS:-default det det_nographs}; do
  case $v in default) X="";; det) X="--set engine.deterministic=true";; det_nographs) X="--set engine.deterministic=true --set engine.cuda_graphs=false";; esac
  stamp "bench $v"
  timeout 100 python3 -m services.cli $B $X --json $OUT/bench_$v$R.json > /tmp/bench_$v.log 2>&1; echo "rc=$?"; grep -E "tok/s|prefill|decode" /tmp/bench_$v.log | tail -8
done
}
stamp other-tests
[ -n "${SKIP_TESTS:-}" ] || {
FILES="tests/unit/engine/runner/test_torch_runner.py tests/unit/engine/test_overlap.py tests/unit/engine/runner/test_cuda_graphs.py"
timeout ${TEST_S:-150} python3 -m pytest -q -rfE -p no:randomly -p no:cacheprovider -n 3 --dist loadfile $FILES > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -8 "$OUT/tests.log"
}
stamp done
