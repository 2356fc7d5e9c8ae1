#!/bin/bash
# One device call: A/B of the grammar mask fill (main's code in .gpu/base vs this tree) on
# `tandem bench engine --structured none,json --overlap on`, a CUDA check of the filler,
# llguidance's fill by threads, then the engine's CUDA tests that run without the GGUF.
# usage: .gpu/run.sh [dry]   (dry: CPU, tiny model, short)
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
  PY=python3; DEV=cuda; TINY=; STEPS=${STEPS:-512}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
else
  PY=$ROOT/.venv/bin/python; DEV=cpu; TINY=--tiny; STEPS=16
fi
SITE=/tmp/site
(lscpu | grep -E "Model name|^CPU\(s\)|Flags" ; uptime) >> "$OUT/gpu.txt"
MODEL=/tmp/gpu-smol$DRY
stamp model
[ -d $MODEL ] || PYTHONPATH=$SITE $PY .gpu/make_model.py $MODEL $TINY > /tmp/model.log 2>&1 || { cat /tmp/model.log; exit 1; }
PYTHONPATH=$SITE $PY -c "import torch,sys; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"

B="bench engine -c $ROOT/configs/local.yaml --set model.path=$MODEL --set engine.device=$DEV --set engine.quantization=int4 --structured none,json --overlap on --concurrency 32 --decode-steps $STEPS --prompt-len 200"
for r in 1 2; do
  stamp "round $r base"
  (cd .gpu/base && PYTHONPATH=$ROOT/.gpu/base:$SITE timeout 150 $PY -m services.cli $B --json $OUT/base$r.json > /tmp/base$r.log 2>&1); echo "rc=$?"; grep -E "^torch +on +(none|json)" /tmp/base$r.log
  for g in 1 0; do
    stamp "round $r new grammar_threads=$g"
    PYTHONPATH=$ROOT:$SITE timeout 150 $PY -m services.cli $B --set engine.grammar_threads=$g --json $OUT/new${r}_g$g.json > /tmp/new${r}_g$g.log 2>&1; echo "rc=$?"; grep -E "^torch +on +(none|json)" /tmp/new${r}_g$g.log
  done
done

stamp check
[ -n "${SKIP_CHECK:-}" ] || PYTHONPATH=$ROOT:$SITE timeout 150 $PY .gpu/check_grammar.py $MODEL $DEV 2>&1 | grep -v Warn | tail -4

stamp tests
if [ -z "$DRY" ] && [ -z "${SKIP_TESTS:-}" ]; then
FILES="tests/unit/engine/runner/test_torch_runner.py tests/unit/engine/test_overlap.py tests/unit/engine/runner/test_cuda_graphs.py"
PYTHONPATH=$ROOT:$SITE timeout ${TEST_S:-150} $PY -m pytest -q -rfE -p no:randomly -p no:cacheprovider -n 3 --dist loadfile \
  $FILES > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -15 "$OUT/tests.log"
fi
stamp done
