"""How long a prefill takes on an engine, from its step-time model: what the router's ttft
policy and the decode worker's remote-prefill decision predict with.

The scheduler prefills a prompt in chunks of at most ``engine.max_num_batched_tokens``
tokens a step, each step also decoding the running sequences. For a model linear in the
shape's fields (StepModel.steps_seconds), the chunks' time is that of their summed shape, in
closed form here: no loop over chunks on a route.
"""

from __future__ import annotations

from services.steptime.model import BatchShape, StepModel


def prefill_shape(tokens: int, chunk: int, start: int = 0, decode_seqs: int = 0,
                  decode_context: int = 0) -> tuple[BatchShape, int]:
    """The summed shape and the number of the steps that prefill ``tokens`` tokens after a
    computed prefix of ``start`` tokens, ``chunk`` tokens a step, each beside ``decode_seqs``
    decodes reading ``decode_context`` tokens of KV. ``tokens`` 0: no step."""
    if tokens <= 0:
        return BatchShape(), 0
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    steps = -(-tokens // chunk)
    full = steps - 1  # chunks of ``chunk`` tokens; the last holds the rest
    last = tokens - full * chunk
    end = start + tokens
    # sum over chunks of tokens * end position: full chunks end at start + k*chunk
    context = chunk * (full * start + chunk * full * (full + 1) // 2) + last * end
    if start:
        prefix_context, prefix_end = context, full * start + chunk * full * (full + 1) // 2 + end
    else:  # the first chunk starts at 0: it is a fresh prompt's, the rest follow a prefix
        first = min(chunk, tokens)
        prefix_context = context - first * first
        prefix_end = (chunk * full * (full + 1) // 2 - chunk + end) if full else 0
    return BatchShape(tokens, context, decode_seqs * steps, decode_context * steps,
                      prefix_context, prefix_end), steps


def prefill_seconds(model: StepModel, tokens: int, chunk: int, start: int = 0,
                    decode_seqs: int = 0, decode_context: int = 0) -> float:
    """Seconds of the steps ``prefill_shape`` describes on ``model``'s device."""
    shape, steps = prefill_shape(tokens, chunk, start, decode_seqs, decode_context)
    return model.steps_seconds(shape, steps) if steps else 0.0
