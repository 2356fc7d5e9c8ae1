#!/bin/bash
# Served 32 streams and the engine's decode at 32 with the LM head's dense copy at 32 rows
# (quantized_max_rows auto = 16) and without it (64: the int4 kernels on tandem's own pool).
# Usage (repo root): benchmarks/results/greedy_isa_2026-11-28/lm_head_ab.sh N
set -u
N=${1:-2}; OUTD=benchmarks/results/greedy_isa_2026-11-28/lm_head
mkdir -p $OUTD
for i in $(seq 1 $N); do
  for q in auto 64; do
    echo "qmr=$q pair $i: $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/tandem bench anchor --phases served --threads 2 --itl-prompt 16 --itl-out 128 --itl-requests 2 \
      --streams 32 --stream-requests 64 --set engine.quantized_max_rows=$q --json $OUTD/served_${q}_$i.json 2>&1 | grep "tandem served:"
    .venv/bin/tandem bench engine --threads 2 --concurrency 32 --decode-steps 96 --runners torch \
      --set engine.quantized_max_rows=$q --json $OUTD/engine_${q}_$i.json 2>&1 | tail -1
  done
done
