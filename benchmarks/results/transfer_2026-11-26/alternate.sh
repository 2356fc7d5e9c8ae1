set -e
R=/work/main/benchmarks/results/transfer_2026-11-26
for r in 1 2; do
  for side in before after; do
    if [ $side = before ]; then D=/tmp/oldwt; else D=/work/main; fi
    cd $D
    echo "$side $r load $(cut -d' ' -f1-3 /proc/loadavg)"
    /work/main/.venv/bin/python -m services.cli bench kv-transfer --json $R/kv_${side}_$r.json > /dev/null 2>&1
    /work/main/.venv/bin/python -m services.cli bench mm-transfer --json $R/mm_${side}_$r.json > /dev/null 2>&1
  done
done
echo "end load $(cut -d' ' -f1-3 /proc/loadavg)"
