"""Tensor parallelism: the entry rank's runner, the extra rank processes, and the control
plane between them (request payload broadcast, per-step messages). docs/engine.md,
"Tensor parallelism"."""
