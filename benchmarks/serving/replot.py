"""Redraw the TTFT/ITL CDFs of `tandem bench compare --json` files.

Usage: python benchmarks/serving/replot.py OUT_DIR RESULT.json...   (PNG prefix: file stem)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from services.bench.plots import latency_cdfs

if __name__ == "__main__":
    out = Path(sys.argv[1])
    for path in map(Path, sys.argv[2:]):
        res = json.loads(path.read_text())
        ttft = {n: [r["ttft_ms"] for r in v["requests"] if r["ok"]] for n, v in res.items()}
        itl = {n: v["itl_ms"] for n, v in res.items()}
        for p in latency_cdfs(ttft, itl, out, prefix=f"serving_{path.stem}_"):
            print(p)
