#!/bin/bash
# Served 32 streams of short prompts with engine.stream_interval 1 (every token a message)
# and the default (auto: 2 at 16+ sequences a step), then the engine's own decode at 32.
# usage: interval_ab.sh N OUTDIR   (from the repo root)
set -u
N=${1:-3}; OUTD=${2:-benchmarks/results/served_sched_2026-11-28}
served() {
  .venv/bin/tandem bench anchor --phases served --threads 2 --itl-prompt 16 --itl-out 128 --itl-requests 2 \
    --streams 32 --stream-requests 64 "$@" 2>&1 | grep "tandem served:"
}
for i in $(seq 1 $N); do
  echo "pair $i: $(uptime)"
  echo "interval 1: $(served --set engine.stream_interval=1 --json $OUTD/served_i1_$i.json)"
  echo "auto:       $(served --json $OUTD/served_auto_$i.json)"
  .venv/bin/tandem bench engine --threads 2 --concurrency 32 --decode-steps 96 --runners torch \
    --json $OUTD/engine_$i.json 2>&1 | tail -1
done
echo "end: $(uptime)"
