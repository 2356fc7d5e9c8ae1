"""`--rates`: one running cluster driven at each rate in turn, and the sweep's tables, JSON
and plot (`bench serve` for one cluster, `bench compare` for each of its runs).

Every rate sends the same request list (``--seed``: same lengths, order and Poisson gaps,
scaled by the rate) after a ``--rate-settle`` pause in which the previous rate's requests
have all finished. NOTE: the cluster is not restarted between rates, so its prefix cache
still holds the previous rates' prompts; rate k therefore sends the list with every token
id shifted by k (``workloads.shifted_ids``), which keeps the sharing within the list (and
the oracle hit rate) and leaves nothing to hit from an earlier rate. What does carry over
is what a warm server has: loaded weights, compiled kernels, the router's worker list.

The result file holds ``sweep`` (``sweep.sweep_json``: every layout's points and goodput,
and each layout against the first) and ``rate_runs`` (NAME -> one `bench serve` result per
rate, ascending; per-request rows left out of ``--summary-json``).
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.bench.metrics import parse_slos
from services.bench.results import write_json
from services.bench.serve import build_workload, format_summary, run_and_measure, slim
from services.bench.sweep import LayoutSweep, RatePoint, comparison_table, layout_table, sweep_json
from services.bench.workloads import shifted_ids


def run_rates(args: argparse.Namespace, base_url: str, model: str,
              rates: Sequence[float]) -> list[dict]:
    """One `bench serve` result per rate, in the order given, each printed as it ends."""
    base = build_workload(args)
    results: list[dict] = []
    for k, rate in enumerate(rates):
        if k:
            time.sleep(args.rate_settle)
        at_rate = copy.copy(args)
        at_rate.rate = rate
        print(f"-- {rate:g} req/s", flush=True)
        res = run_and_measure(at_rate, base_url, model, shifted_ids(base, k))
        res["meta"]["token_id_shift"] = k
        print(format_summary(res), flush=True)
        results.append(res)
    return results


def report(head: dict, runs: Mapping[str, Sequence[dict]], rates: Sequence[float],
           args: argparse.Namespace) -> list[LayoutSweep]:
    """Print each layout's table and the side-by-side summary; write ``--json``,
    ``--summary-json`` (where the command has it) and ``--plot``'s attainment plot."""
    slos = parse_slos(args.slo)
    sweeps = [LayoutSweep.of(name, [RatePoint.of(r, res, slos)
                                    for r, res in zip(rates, results, strict=True)],
                             args.attainment)
              for name, results in runs.items()]
    for s in sweeps:
        print("\n" + layout_table(s, args.attainment))
    print("\n" + comparison_table(sweeps, args.attainment), flush=True)
    section = sweep_json(sweeps, rates, args.attainment, slos)
    write_json(args.json_path, {**head, "sweep": section, "rate_runs": dict(runs)})
    write_json(getattr(args, "summary_json", None),
               {**head, "sweep": section,
                "rate_runs": {n: [slim(r) for r in rs] for n, rs in runs.items()}})
    if args.plot_dir:
        from services.bench.plots import attainment_plot

        path = Path(args.plot_dir) / f"{getattr(args, 'plot_prefix', '')}slo_attainment.png"
        print(f"wrote {attainment_plot(sweeps_series(sweeps), args.attainment, path)}")
    return sweeps


def sweeps_series(sweeps: Sequence[LayoutSweep]) -> dict[str, tuple[list[float], list[float]]]:
    """NAME -> (rates, attainments): what the attainment plot draws."""
    return {s.name: ([p.rate for p in s.points], [p.attainment for p in s.points]) for s in sweeps}
