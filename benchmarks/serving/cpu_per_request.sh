#!/usr/bin/env bash
# CPU time each part spends per request (docs/benchmarks.md "Stack overhead"): starts the
# one-worker zero-cost mock cluster on ports clear of scale-mock.yaml's, sends N sequential
# requests over HTTP (overhead.py's http_raw layer), and divides each process's user+system
# CPU time (/proc/PID/stat) over the run by N.
# Usage: benchmarks/serving/cpu_per_request.sh [N]   (default 1000)
set -eu
n=${1:-1000}
tandem=${TANDEM:-"python -m services.cli"}
sets="--set decode.replicas=1 --set decode.replicas_per_process=1 --set engine.mock.step_base_s=0"
sets="$sets --set engine.mock.per_prefill_token_s=0 --set engine.mock.per_decode_seq_s=0"
sets="$sets --set nats.url=nats://127.0.0.1:4522 --set frontend.port=8300 --set processor.port=9130"
sets="$sets --set processor.metrics_port=9131 --set router.port=9230 --set router.metrics_port=9231"
sets="$sets --set decode.port=9630 --set decode.metrics_port=9730"
$tandem up -c configs/scale-mock.yaml $sets > /tmp/cpu_per_request_up.log 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null' EXIT
for _ in $(seq 90); do curl -sf http://127.0.0.1:8300/health > /dev/null && break; sleep 1; done
ticks() {  # "part ticks" for every part and nats-server of this cluster
  for part in frontend processor router decode; do
    echo "$part $(awk '{print $14 + $15}' /proc/$(pgrep -f "services.cli $part.*4522" | head -1)/stat)"
  done
  echo "nats-server $(awk '{print $14 + $15}' /proc/$(pgrep -f 'nats-server.*4522' | head -1)/stat)"
}
run() {
  PYTHONPATH=. python benchmarks/serving/overhead.py -c configs/scale-mock.yaml $sets \
    --base-url http://127.0.0.1:8300 --layers http_raw --warmup 0 --n "$1"
}
run 100 > /dev/null  # warm-up
before=$(ticks)
run "$n" > /tmp/cpu_per_request_ttft.json
after=$(ticks)
python - "$n" "$(getconf CLK_TCK)" "$before" "$after" <<'PY'
import json, sys
n, hz = int(sys.argv[1]), int(sys.argv[2])
a = dict(line.split() for line in sys.argv[3].splitlines())
b = dict(line.split() for line in sys.argv[4].splitlines())
ms = {k: round((int(b[k]) - int(a[k])) * 1000 / hz / n, 3) for k in a}
ttft = json.load(open("/tmp/cpu_per_request_ttft.json"))["http_raw"]
print(json.dumps({"requests": n, "cpu_ms_per_request": ms, "total": round(sum(ms.values()), 3),
                  "ttft_ms_p50": round(ttft["p50"], 3)}, indent=1))
PY
