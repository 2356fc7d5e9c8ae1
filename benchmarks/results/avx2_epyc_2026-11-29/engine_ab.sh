#!/bin/bash
# The engine alone, the code before this day's AVX2 kernel changes (a worktree of f872576 at
# $BEFORE) and this checkout alternating: prefill of 850 tokens, decode at 1 and 32.
# usage (repo root): engine_ab.sh ROUNDS BEFORE_DIR OUTDIR
N=${1:-3}; BEFORE=${2:-/tmp/wt_orig}; OUT=${3:-benchmarks/results/avx2_epyc_2026-11-29}
HERE=$(pwd)
for i in $(seq 1 $N); do
  for side in before after; do
    d=$HERE; [ $side = before ] && d=$BEFORE
    echo "$side $i, load $(cut -d' ' -f1 /proc/loadavg): $(cd $d && $HERE/.venv/bin/python -m services.cli bench engine \
      --threads 2 --prompt-len 850 --concurrency 1,32 --decode-steps 64 --runners torch \
      --json $HERE/$OUT/engine_${side}_$i.json 2>&1 | grep -E 'prefill|  32 |  1 ' | tr -s ' ' | tr '\n' ';')"
  done
done
