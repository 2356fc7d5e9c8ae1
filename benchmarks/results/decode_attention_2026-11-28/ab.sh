#!/bin/bash
# The decode attention before (git HEAD's decode.cpp / simd.h) and after (the working tree's,
# saved first to $NEW), alternating, with the fixed `bench engine` decode phase.
# usage: ab.sh ROUNDS NEW_DIR OUT_DIR   (from the repo root)
set -u
N=$1; NEW=$2; OUT=$3
K=services/engine/cpu_kernels
run() {
  local tag=$1
  .venv/bin/tandem bench engine --threads 1 --concurrency 8 --decode-steps 32 --decode-context 1024 --runners torch \
    --json $OUT/${tag}_t1_c8_ctx1024.json 2>&1 | tail -1
  .venv/bin/tandem bench engine --threads 2 --concurrency 32 --decode-steps 64 --decode-context 480 --runners torch \
    --json $OUT/${tag}_t2_c32_ctx480.json 2>&1 | tail -1
  .venv/bin/tandem bench engine --threads 2 --concurrency 32 --decode-steps 96 --runners torch \
    --json $OUT/${tag}_t2_c32_ctx32.json 2>&1 | tail -1
}
for i in $(seq 1 $N); do
  echo "round $i: $(uptime)"
  git checkout -q HEAD -- $K/decode.cpp $K/simd.h; echo before; run before_$i
  cp $NEW/decode.cpp $NEW/simd.h $K/; echo after; run after_$i
done
cp $NEW/decode.cpp $NEW/simd.h $K/
echo "end: $(uptime)"
