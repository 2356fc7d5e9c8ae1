"""`tandem bench compare --preset NAME`: the runs and workload of each serving table in
docs/benchmarks.md, so that a table's command is one line and the recipe lives in code.

A preset sets workload options and a list of runs. Options given after ``--preset``
override its values (``--slo`` adds to its SLOs); explicit ``--run``s replace its runs;
``--set-all KEY=VALUE`` adds an override to every run (e.g. ``decode.replicas=64``).
Kept free of heavy imports: `tandem --help` builds every parser.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    help: str
    runs: tuple[str, ...]  # NAME=FILE[@key=value,...], as --run takes them
    options: Mapping[str, object]  # argparse dest -> value


def _modes(config: str, modes: Sequence[str], extra: str = "") -> tuple[str, ...]:
    return tuple(f"{m}={config}@router.mode={m}{extra}" for m in modes)


_MOCK_MODES = ("round_robin", "random", "kv", "ttft")

PRESETS: dict[str, Preset] = {
    "mock-mooncake": Preset(
        "routing on 16 mock workers (--set-all decode.replicas=64 for 64): the whole Mooncake "
        "trace (give --trace) 10x faster, 512-token blocks scaled to 16",
        _modes("configs/scale-mock.yaml", _MOCK_MODES),
        {"workload": "mooncake", "scale": 1 / 32, "num_requests": 4000, "arrival": "trace",
         "speedup": 10.0, "slo": ["ttft_ms=2000"]}),
    "mock-shared": Preset(
        "routing on 16 mock workers (--set-all decode.replicas=64 for 64): 64 system prompts "
        "of 512 tokens, 800 requests at 20 req/s",
        _modes("configs/scale-mock.yaml", _MOCK_MODES),
        {"workload": "shared-prefix", "groups": 64, "system_len": 512, "question_len": 32,
         "output_len": 16, "num_requests": 800, "arrival": "poisson", "rate": 20.0,
         "slo": ["ttft_ms=2000"]}),
    # 8 system prompts of 32 blocks (256 in all) over 2 workers caching 160 blocks each:
    # together they hold every prompt, alone about half, so placement decides what stays
    # cached (round robin makes each cache churn through all 8).
    "real-routing-pressure": Preset(
        "routing with the real model on 2 workers under cache pressure (round_robin, kv)",
        _modes("configs/agg.yaml", ("round_robin", "kv", "ttft"), ",engine.num_kv_blocks=160"),
        {"workload": "shared-prefix", "groups": 8, "system_len": 512, "question_len": 16,
         "output_len": 8, "num_requests": 80, "arrival": "poisson", "rate": 1.0,
         "slo": ["ttft_ms=2000"]}),
    # long prompts (768 > decode.disagg.max_local_prefill_length 256) go to the prefill
    # worker in disagg; the same two engine processes in both configs
    "real-disagg": Preset(
        "aggregated (2 decode) vs disaggregated (1 decode + 1 prefill), real model, 25% long "
        "prompts (--long-fraction 0.4 for 40%)",
        ("agg=configs/agg.yaml", "disagg=configs/disagg.yaml@decode.replicas=1,prefill.replicas=1"),
        {"workload": "mixed", "short_len": 32, "long_len": 768, "long_fraction": 0.25,
         "output_len": 32, "num_requests": 40, "arrival": "poisson", "rate": 1.0,
         "slo": ["ttft_ms=3000", "tpot_ms=100"]}),
}


class PresetAction(argparse.Action):
    """Sets the preset's options on the namespace when ``--preset`` is parsed, so options
    after it override them; an option changed before it would be silently lost, so that
    is an error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        preset = PRESETS[str(values)]
        for dest in preset.options:
            if getattr(namespace, dest) != parser.get_default(dest):
                parser.error(f"--{dest.replace('_', '-')} is given before --preset, which sets "
                             "it: put --preset first")
        for dest, value in preset.options.items():
            setattr(namespace, dest, copy.copy(value))
        namespace.preset_runs = list(preset.runs)
        setattr(namespace, self.dest, values)


def preset_help() -> str:
    """The presets for --help (argparse %-formats help strings: '%' doubled)."""
    return "; ".join(f"{name}: {p.help}" for name, p in PRESETS.items()).replace("%", "%%")
