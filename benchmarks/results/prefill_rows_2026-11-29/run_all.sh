#!/bin/bash
# This session's figures, one after another on a quiet machine (repo root; BASE: a worktree
# of the code before, 26b8d40). usage: run_all.sh BASE LLAMA_SERVER
BASE=$1; LS=$2; R=benchmarks/results/prefill_rows_2026-11-29
load() { cut -d' ' -f1 /proc/loadavg; }
echo "fwd_ab, load $(load)"; .venv/bin/python $R/fwd_ab.py $BASE 7 2>&1 | grep -v "^\s*$" | tail -10 > $R/fwd_ab_final.txt
echo "onecall_ab, load $(load)"; .venv/bin/python $R/onecall_ab.py 3 2>&1 | grep tokens > $R/onecall_ab.txt
for i in 1 2; do
  for code in after before; do
    dir=.; [ $code = before ] && dir=$BASE
    echo "anchor $code $i, load $(load)"
    (cd $dir && /work/main/.venv/bin/python -m services.cli bench anchor --threads 2 --llama-server $LS \
      --json /work/main/$R/anchor_${code}_$i.json > /work/main/$R/anchor_${code}_$i.txt 2>&1)
  done
done
echo "anchor after 3, load $(load)"
.venv/bin/python -m services.cli bench anchor --threads 2 --llama-server $LS --json $R/anchor_after_3.json > $R/anchor_after_3.txt 2>&1
echo done
