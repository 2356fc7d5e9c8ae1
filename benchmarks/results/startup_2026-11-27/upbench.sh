#!/bin/bash
# usage: upbench.sh DIR LABEL  -- time `tandem up` of configs/local.yaml from the code in DIR
cd "$1"
LOG=/tmp/dbg/up_$2.log
rm -f $LOG
/work/main/.venv/bin/python -m services.cli up -c configs/local.yaml --run-dir /tmp/dbg/run_$2 > $LOG 2>&1 &
PID=$!
for i in $(seq 1 240); do grep -q "is ready in" $LOG && break; sleep 0.5; done
kill -INT $PID; wait $PID
echo "== $2: $(grep -o 'is ready in [0-9.]* s' $LOG)"; grep "^ready" $LOG
