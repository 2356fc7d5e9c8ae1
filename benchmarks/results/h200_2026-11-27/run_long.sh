#!/bin/bash
# One device call: the split invariant attention (this tree) — its CUDA tests, a long-context
# check, and bench engine at 2,000 tokens of context: dense default, the mode before the
# split (.gpu/base = c7f0a15), the mode now.
set -u
export PYTHONUNBUFFERED=1
unset CI
ROOT=$PWD
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "=== $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
MODEL=/tmp/gpu-smol
stamp model
[ -d $MODEL ] || PYTHONPATH=/tmp/site python3 .gpu/make_model.py $MODEL > /tmp/model.log 2>&1 || { cat /tmp/model.log; exit 1; }
stamp det-tests
PYTHONPATH=$ROOT:/tmp/site TANDEM_TEST_CUDA_MODEL=$MODEL timeout 120 python3 -m pytest -q -rfE -p no:randomly -p no:cacheprovider \
  tests/unit/engine/test_deterministic_cuda.py > "$OUT/det_tests.log" 2>&1; echo "det tests rc=$?"; tail -3 "$OUT/det_tests.log"
PYTHONPATH=$ROOT:/tmp/site timeout 60 python3 .gpu/attn_long.py cuda 2>&1 | tee "$OUT/attn_long.log"
B="bench engine -c $ROOT/configs/local.yaml --set model.path=$MODEL --set engine.device=cuda --set engine.quantization=none --set engine.num_kv_blocks=8192 --set engine.cuda_graph_max_context=4096 --concurrency 1,32 --decode-steps 128 --decode-context 2000 --prompt-len 1000"
for v in default det_old det_new; do
  stamp "bench $v"
  case $v in
    default) PYTHONPATH=$ROOT:/tmp/site timeout 70 python3 -m services.cli $B --json $OUT/long_$v.json > /tmp/b_$v.log 2>&1;;
    det_old) (cd .gpu/base && PYTHONPATH=$ROOT/.gpu/base:/tmp/site timeout 70 python3 -m services.cli $B --set engine.deterministic=true --json $OUT/long_$v.json > /tmp/b_$v.log 2>&1);;
    det_new) PYTHONPATH=$ROOT:/tmp/site timeout 70 python3 -m services.cli $B --set engine.deterministic=true --json $OUT/long_$v.json > /tmp/b_$v.log 2>&1;;
  esac
  echo "rc=$?"; tail -3 /tmp/b_$v.log
done
python3 -c "
import json,glob
for f in sorted(glob.glob('$OUT/long_*.json')):
    r=json.load(open(f))['runs']['torch/overlap-auto']; print(f.split('/')[-1], r['prefill_tok_s'], {k:v['tok_s'] for k,v in r['decode'].items()}, r.get('cuda_graphs'))"
stamp done
