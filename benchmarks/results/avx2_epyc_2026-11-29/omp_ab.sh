#!/bin/bash
# The engine alone with libgomp's default waiting (spin) and OMP_WAIT_POLICY=PASSIVE,
# alternating: prefill of 850 tokens, decode at 1 and 32. usage (repo root): omp_ab.sh ROUNDS OUTDIR
N=${1:-3}; OUT=${2:-benchmarks/results/avx2_epyc_2026-11-29}
for i in $(seq 1 $N); do
  for pol in spin passive; do
    env=(); [ $pol = passive ] && env=(OMP_WAIT_POLICY=PASSIVE)
    echo "$pol $i, load $(cut -d' ' -f1 /proc/loadavg): $(env "${env[@]}" .venv/bin/python -m services.cli bench engine \
      --threads 2 --prompt-len 850 --concurrency 1,32 --decode-steps 64 --runners torch \
      --json $OUT/omp_${pol}_$i.json 2>&1 | grep -E 'prefill|  32 |  1 ' | tr -s ' ' | tr '\n' ';')"
  done
done
