#!/bin/bash
# usage: upbench.sh DIR LABEL -- time `tandem up -c configs/local.yaml` of the code in DIR
# (run with the repository's venv); prints the ready lines, stops the cluster once ready.
set -u
OUT=${OUT:-/tmp/upbench}
mkdir -p "$OUT"
PY=${PY:-$(cd "$(dirname "$0")/../../.." && pwd)/.venv/bin/python}
cd "$1"
LOG=$OUT/up_$2.log
"$PY" -m services.cli up -c configs/local.yaml --run-dir "$OUT/run_$2" > "$LOG" 2>&1 &
PID=$!
for _ in $(seq 1 240); do grep -q "is ready in" "$LOG" && break; sleep 0.5; done
kill -INT $PID; wait $PID
echo "== $2: $(grep -o 'is ready in [0-9.]* s' "$LOG")"; grep "^ready" "$LOG"
