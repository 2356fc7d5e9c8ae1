#!/bin/bash
# Loopback transfers on the device's 16-core host (no GPU used): `bench kv-transfer` and
# `bench mm-transfer` with their defaults, where the receiving process has cores to itself.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
(lscpu | grep -E "Model name|^CPU\(s\)|Flags"; uptime; nproc) > "$OUT/host.txt"
git log -1 --format='%H %s' >> "$OUT/host.txt" 2>/dev/null
for i in 1 2; do
  timeout 150 python3 -m services.cli bench kv-transfer --json $OUT/kv_$i.json > $OUT/kv_$i.log 2>&1; echo "kv $i rc=$?"; grep -iE "overall|GB/s" $OUT/kv_$i.log | tail -3
  timeout 100 python3 -m services.cli bench mm-transfer --json $OUT/mm_$i.json > $OUT/mm_$i.log 2>&1; echo "mm $i rc=$?"; grep -iE "overall|GB/s" $OUT/mm_$i.log | tail -3
done
uptime >> "$OUT/host.txt"
