#!/bin/bash
# The planner against every fixed split over a grid of the shifting load: budgets 4 and 8,
# phases of 60, 120 and 180 s, seeds 0 and 1 (tandem sim planner-eval, ~5 min on 2 cores).
# usage: grid.sh TAG [planner-eval args...]; results in ${GRID_DIR:-/tmp/grid}/TAG.
set -e
cd "$(dirname "$0")/../../../../.."
dir=${GRID_DIR:-/tmp/grid}/$1; shift
for b in 4 8; do for ph in 60 120 180; do for seed in 0 1; do
  .venv/bin/python -m services.cli sim planner-eval -c configs/disagg.yaml --budgets $b \
    --phase-s $ph --seed $seed --out "$dir/b${b}p${ph}s${seed}" "$@" > /dev/null 2>&1
done; done; done
.venv/bin/python - "$dir" <<'PY'
import glob, json, statistics, sys
ratios = []
for f in sorted(glob.glob(f"{sys.argv[1]}/*/budget*.json")):
    d = json.load(open(f))
    best = max((r for r in d["runs"] if r["run"].startswith("fixed")), key=lambda r: r["goodput_fraction"])
    pl, fo = d["runs"][0], d["runs"][1]
    ratios.append(pl["goodput_fraction"] / best["goodput_fraction"])
    print(f"{f.split('/')[-2]:>12} planner {pl['goodput_fraction']:.3f} {pl['phase_goodput']} "
          f"formula {fo['goodput_fraction']:.3f} best {best['run']} {best['goodput_fraction']:.3f} "
          f"ratio {ratios[-1]:.2f} fail {pl['failed']}")
print("geomean ratio", round(statistics.geometric_mean([max(r, 1e-3) for r in ratios]), 3),
      "min", round(min(ratios), 2), "wins", sum(r >= 1 for r in ratios), "/", len(ratios))
PY
