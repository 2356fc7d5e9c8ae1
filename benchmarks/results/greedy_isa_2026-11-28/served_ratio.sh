#!/bin/bash
# Served 32 streams of short prompts against the engine's own decode at 32, alternating:
# the script of served_ratio_2026-11-27, writing here. Usage (repo root): served_ratio.sh N
exec bash benchmarks/results/served_ratio_2026-11-27/run.sh "${1:-3}" benchmarks/results/greedy_isa_2026-11-28
