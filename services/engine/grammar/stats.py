"""Grammar counters, kept as plain numbers by the threads that do the work and read by a
Prometheus collector at scrape time (``metrics``), like ``EngineStats``."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from services.engine.histogram import Histogram

# Seconds: compiles take 0.1 ms (a cached schema's copy) to seconds (a huge schema); a
# mask fill is micro- to milliseconds per step.
COMPILE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
FILL_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


@dataclass(slots=True)
class GrammarStats:
    compile_seconds: Histogram = field(default_factory=lambda: Histogram(COMPILE_BUCKETS))
    mask_fill_seconds: Histogram = field(default_factory=lambda: Histogram(FILL_BUCKETS))
    # The sampler's wait for a mask not yet filled: what the grammar costs a step.
    mask_wait_seconds: Histogram = field(default_factory=lambda: Histogram(FILL_BUCKETS))
    requests_by_kind: Counter[str] = field(default_factory=Counter)
    errors: int = 0  # requests ended by a grammar error (a rejected token, a matcher error)
    lock: threading.Lock = field(default_factory=threading.Lock)  # compiles run off the step thread
