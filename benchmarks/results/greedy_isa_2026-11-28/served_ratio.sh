#!/bin/bash
# Served 32 streams of short prompts against the engine's own decode at 32, alternating.
# usage: run.sh N OUTDIR   (from the repo root)
set -u
N=${1:-3}; OUTD=${2:-benchmarks/results/greedy_isa_2026-11-28}
for i in $(seq 1 $N); do
  echo "pair $i: $(uptime)"
  .venv/bin/tandem bench anchor --phases served --threads 2 --itl-prompt 16 --itl-out 128 --itl-requests 2 \
    --streams 32 --stream-requests 64 --json $OUTD/served_$i.json 2>&1 | grep "tandem served:"
  .venv/bin/tandem bench engine --threads 2 --concurrency 32 --decode-steps 96 --runners torch \
    --json $OUTD/engine_$i.json 2>&1 | tail -1
done
echo "end: $(uptime)"
