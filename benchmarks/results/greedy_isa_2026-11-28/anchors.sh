#!/bin/bash
# tandem bench anchor, this checkout (after) and the code before (a worktree of 210ea03 at
# $BEFORE), against llama-server builds of benchmarks/build_llama_server.sh.
# Usage (repo root): NATIVE=... AVX2=... BEFORE=/tmp/wt_before benchmarks/results/greedy_isa_2026-11-28/anchors.sh
set -u
OUT=$PWD/benchmarks/results/greedy_isa_2026-11-28; ROOT=$PWD
run() { # label dir server extra...
  local label=$1 dir=$2 server=$3; shift 3
  echo "== $label: $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd $dir && PYTHONPATH=$dir $ROOT/.venv/bin/python -m services.cli bench anchor --threads 2 --llama-server $server "$@" \
     --json $OUT/anchor_$label.json 2>&1 | grep -E "^(prefill|decode|served|tandem served ITL)")
}
run auto_after_1 $ROOT $NATIVE
run avx2_before_1 $BEFORE $AVX2 --set engine.cpu_isa=avx2
run auto_after_2 $ROOT $NATIVE
run avx2_after_2 $ROOT $AVX2 --set engine.cpu_isa=avx2
