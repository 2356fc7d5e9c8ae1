"""`tandem bench mm-transfer` measures both modes over real gRPC (tiny sizes: a smoke run,
not a measurement) and `mm-ttft` parses."""

from __future__ import annotations

import asyncio

from services.bench.mm_transfer import _bench
from services.cli import build_parser


def test_mm_transfer_reports_both_modes():
    out = asyncio.run(_bench([10, 300], hidden=8, repeats=1, resume_blocks=1))
    assert out["no_resume_gb_s"] > 0 and out["resume_gb_s"] > 0
    big = out["by_rows"]["300"]
    assert big["bytes"] == 300 * 8 * 4
    assert big["no_resume"]["first_buffer_rows"] == 384 and big["resume"]["first_buffer_rows"] == 128


def test_mm_ttft_parser():
    args = build_parser().parse_args(["bench", "mm-ttft", "--base-url", "http://x", "--model", "m", "--images", "3",
                                      "--label", "local-encode"])
    assert args._key == ("bench", "mm-ttft") and args.images == 3 and args.label == "local-encode"
