"""Shared test fixtures. Tests run CPU-only with tiny configs unless marked."""

from __future__ import annotations

import os

import torch

# Two cores on the dev machine and in CI: keep each test process to one torch thread.
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "1")))
