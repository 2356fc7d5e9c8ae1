"""The parser of `tandem sim` (replay a trace or workload) and its subcommands. Kept free
of heavy imports: `tandem --help` builds every parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from services.bench.args import add_workload_args
from services.sim.calibrate_args import add_calibrate_parser

# `tandem sim profile --check`: the mean relative error past which a profile no longer
# describes this machine (the calibration's own target).
CHECK_TOLERANCE = 0.10

AddConfig = Callable[[argparse.ArgumentParser], None]


def add_sim_parsers(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    # NOTE: no abbreviations: the parent would read `profile --out` as its --output-len.
    p = sub.add_parser(
        "sim", allow_abbrev=False,
        help="simulate a whole cluster on a virtual clock (docs/simulator.md)",
        description="Replay a trace (--trace FILE: Mooncake JSONL or Azure CSV, at full "
                    "length) or a bench workload (--workload, as `tandem bench serve` sends "
                    "it) through the production router and schedulers, with a step-time "
                    "model in place of the forward (engine.step_model).")
    add_config(p)
    add_workload_args(p)
    # NOTE: no workload named = replay --trace itself; a named one is built as the bench does.
    p.set_defaults(workload=None, num_requests=None, _key=("sim",))
    t = p.add_argument_group("trace replay (--trace without --workload)")
    t.add_argument("--format", choices=("auto", "mooncake", "azure"), default="auto")
    t.add_argument("--window", default=None, metavar="START:END",
                   help="keep requests sent in [START, END) seconds of the trace's clock")
    t.add_argument("--sample-mod", type=int, default=None, metavar="M",
                   help="keep whole conversations: requests whose hash_ids[1] %% M == 0 "
                        "(the rule of ../shared/anchors/dynamo_replay.py)")
    o = p.add_argument_group("output")
    o.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                   help="write the summary (with the command line and machine) here")
    o.add_argument("--requests-jsonl", default=None, metavar="FILE",
                   help="one JSON line per request")
    o.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    o.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="run the cross product of these config values (repeatable), one "
                        "process per point, one table row each")
    o.add_argument("--processes", type=int, default=None,
                   help="sweep points run at once (default: the CPU count)")
    o.add_argument("--no-fast-forward", dest="fast_forward", action="store_false",
                   help="step every decode one by one (same results, slower: for checking)")
    o.add_argument("--planner", action="store_true",
                   help="run the planner in the simulation (as planner.enabled: true): the "
                        "split moves every planner.interval_s; the summary gains its timeline")
    sub_sim = p.add_subparsers(dest="sim_command")
    prof = sub_sim.add_parser("profile", help="time the real engine's steps here and write a "
                              "step-time profile for engine.step_model")
    add_config(prof)
    what = prof.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", metavar="FILE", help="the profile YAML to write")
    what.add_argument("--check", metavar="FILE",
                      help="time the quick grid here and compare it with this profile: a "
                           "profile describes the machine it was measured on, and another "
                           "instance of the same CPU model can differ by a quarter; exits 1 "
                           f"when the mean error passes {CHECK_TOLERANCE * 100:.0f}%% or the "
                           f"max {CHECK_TOLERANCE * 200:.0f}%%")
    prof.add_argument("--quick", action="store_true",
                      help="a small grid (about a minute on a CPU); --check always uses it")
    prof.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                      help="with --check: write its verdict here (mean and max error, stale, "
                           "each point timed beside the profile's time; with the command line "
                           "and machine)")
    prof.set_defaults(_key=("sim", "profile"))
    add_calibrate_parser(sub_sim, add_config)
    add_decisions_parser(sub_sim, add_config)
    add_planner_eval_parser(sub_sim, add_config)


def add_decisions_parser(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    """`tandem sim decisions` (services/sim/decisions.py)."""
    p = sub.add_parser("decisions", help="routing and remote-prefill policies replayed on "
                       "traces at fractions of round robin's saturation")
    add_config(p)
    p.add_argument("--trace", dest="traces", action="append", required=True, metavar="FILE",
                   help="a Mooncake JSONL or Azure CSV trace (repeatable)")
    p.add_argument("--workers", default="8,16,64", help="cluster sizes, comma-separated")
    p.add_argument("--loads", default="0.5,0.9",
                   help="fractions of round robin's saturation speedup")
    p.add_argument("--num-requests", type=int, default=None,
                   help="replay only the first N requests of each trace")
    p.add_argument("--no-prefill", dest="prefill", action="store_false",
                   help="skip the remote-prefill policies (disaggregated layout)")
    p.add_argument("--prefill-router", default="ttft",
                   help="router.mode of the disaggregated runs")
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE")
    p.set_defaults(_key=("sim", "decisions"))


def _positive(v: str) -> float:
    x = float(v)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return x


def add_planner_eval_parser(sub: argparse._SubParsersAction, add_config: AddConfig) -> None:
    """`tandem sim planner-eval` (services/sim/planner_eval.py)."""
    p = sub.add_parser("planner-eval", help="the planner against every fixed split of a worker "
                       "budget and the config's own split, on a shifting load (docs/planner.md)")
    add_config(p)
    p.add_argument("--budgets", default="8", help="worker budgets, comma-separated")
    p.add_argument("--phase-s", type=float, default=180.0,
                   help="virtual seconds of each of the workload's three phases")
    p.add_argument("--time-scale", type=_positive, default=1.0, metavar="K",
                   help="run on a mock device K times slower, the load, the targets and the "
                   "planner's periods stretched with it (phases K x --phase-s; "
                   "benchmarks/planner_live.py's setting, docs/planner.md)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    p.add_argument("--out", default="benchmarks/results/planner", metavar="DIR",
                   help="budget<N>.json and the plots go here")
    p.add_argument("--only", choices=("planner",), default=None,
                   help="planner: run only the config's policy (no fixed splits, no verdict, "
                   "no plots), to iterate on a policy")
    p.set_defaults(_key=("sim", "planner-eval"))
