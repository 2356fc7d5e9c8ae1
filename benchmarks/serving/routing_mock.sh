#!/usr/bin/env bash
# Routing at scale on mock workers (docs/benchmarks.md "Serving: routing"): round_robin,
# random and kv (default overlap_weight 4) on the Mooncake trace and on a shared-prefix workload, 16 and 64 workers.
# Usage: [EXTRA_WEIGHTS="1 8"] benchmarks/serving/routing_mock.sh OUT_DIR [WORKERS...]   (default workers: 16 64)
set -u
out=${1:?OUT_DIR}; shift
workers=${*:-16 64}
tandem=${TANDEM:-"python -m services.cli"}
mkdir -p "$out"
for n in $workers; do
  runs=()
  for mode in round_robin random kv; do
    runs+=(--run "$mode=configs/scale-mock.yaml@router.mode=$mode,decode.replicas=$n")
  done
  # more kv variants, e.g. EXTRA_WEIGHTS="1 8": router.overlap_weight (default 4)
  for w in ${EXTRA_WEIGHTS:-}; do
    runs+=(--run "kv_w$w=configs/scale-mock.yaml@router.mode=kv,router.overlap_weight=$w,decode.replicas=$n")
  done
  # Mooncake: the whole trace (3,993 requests, 1,022 s) 10x faster; 512-token blocks -> 16
  $tandem bench compare "${runs[@]}" --workload mooncake \
    --trace /work/shared/traces/synthetic_trace.jsonl --scale 0.03125 --num-requests 4000 \
    --arrival trace --speedup 10 --slo ttft_ms=2000 \
    --json "$out/mooncake_$n.json" --plot "$out/plots" --plot-prefix "mooncake_${n}_" \
    --log-dir "$out/logs" > "$out/mooncake_$n.txt" 2>&1
  # shared prefix: 64 system prompts of 512 tokens, 32-token questions, 16 output tokens
  $tandem bench compare "${runs[@]}" --workload shared-prefix --groups 64 --system-len 512 \
    --question-len 32 --output-len 16 --num-requests 800 --arrival poisson --rate 20 \
    --slo ttft_ms=2000 \
    --json "$out/shared_$n.json" --plot "$out/plots" --plot-prefix "shared_${n}_" \
    --log-dir "$out/logs" > "$out/shared_$n.txt" 2>&1
done
