#!/usr/bin/env bash
# The real SmolLM2 behind the whole stack (docs/benchmarks.md "Serving"): routing with 2
# decode workers, then aggregated (2 decode) vs disaggregated (1 decode + 1 prefill).
# Ports are moved off local.yaml's so it runs next to another cluster.
# Usage: benchmarks/serving/real_model.sh OUT_DIR [routing] [routing-pressure] [disagg]
set -u
out=${1:?OUT_DIR}; shift
parts=${*:-routing disagg}
tandem=${TANDEM:-"python -m services.cli"}
mkdir -p "$out"
ports="nats.url=nats://127.0.0.1:4422,frontend.port=8200,processor.port=9120"
ports="$ports,processor.metrics_port=9121,router.port=9220,router.metrics_port=9221"
ports="$ports,decode.port=9900,decode.metrics_port=9910,prefill.metrics_port=9920"
for part in $parts; do
  if [ "$part" = routing ]; then
    # 6 system prompts of 256 tokens over 2 workers whose caches (96 blocks = 1,536 tokens)
    # hold about half of them: where placement decides what stays cached.
    runs=()
    for mode in ${MODES:-round_robin random kv}; do
      runs+=(--run "$mode=configs/agg.yaml@$ports,router.mode=$mode,engine.num_kv_blocks=96")
    done
    $tandem bench compare "${runs[@]}" --workload shared-prefix --groups 6 --system-len 256 \
      --question-len 32 --output-len 16 --num-requests 60 --arrival poisson --rate 1.5 \
      --slo ttft_ms=2000 --json "$out/real_routing.json" --plot "$out/plots" \
      --plot-prefix real_routing_ --log-dir "$out/logs" > "$out/real_routing.txt" 2>&1
  fi
  if [ "$part" = routing-pressure ]; then
    # 8 system prompts of 512 tokens (32 blocks each, 256 in all) over 2 workers that
    # cache 160 blocks each: together they hold every prompt, alone about half. Round
    # robin sends every prompt to both (each cache churns through all 8); kv keeps each
    # prompt on one worker.
    runs=()
    for mode in ${MODES:-round_robin random kv}; do
      runs+=(--run "$mode=configs/agg.yaml@$ports,router.mode=$mode,engine.num_kv_blocks=160")
    done
    $tandem bench compare "${runs[@]}" --workload shared-prefix --groups 8 --system-len 512 \
      --question-len 16 --output-len 8 --num-requests ${NUM_REQUESTS:-80} --arrival poisson \
      --rate ${RATE:-1.0} --slo ttft_ms=2000 --json "$out/real_routing_pressure.json" \
      --plot "$out/plots" --plot-prefix real_routing_pressure_ --log-dir "$out/logs" \
      > "$out/real_routing_pressure.txt" 2>&1
  fi
  if [ "$part" = disagg ]; then
    # a quarter of the prompts are 768 tokens (remote prefill: > max_local_prefill_length
    # 256), the rest 32; 32 output tokens each
    $tandem bench compare \
      --run "agg=configs/agg.yaml@$ports" \
      --run "disagg=configs/disagg.yaml@$ports,decode.replicas=1,prefill.replicas=1" \
      --workload mixed --short-len 32 --long-len 768 --long-fraction ${LONG_FRACTION:-0.25} --output-len 32 \
      --num-requests 40 --arrival poisson --rate 1.0 --slo ttft_ms=3000 --slo tpot_ms=100 \
      --json "$out/real_disagg.json" --plot "$out/plots" --plot-prefix real_disagg_ \
      --log-dir "$out/logs" > "$out/real_disagg.txt" 2>&1
  fi
done
