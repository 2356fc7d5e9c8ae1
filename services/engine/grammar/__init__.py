"""Structured output: a request's grammar (``StructuredOutput``, services/api/structured.py),
compiled and cached per worker (``compiler``), one matcher per request advanced by each accepted token (``state``), and
the allowed-token bitmask of a batch, filled on the scheduler thread and applied to the
logits before sampling (``batch_mask``). docs/engine.md "Constrained decoding"."""
