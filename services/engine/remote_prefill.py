"""Decode side of disaggregation: park a request while its prompt KV is computed elsewhere.

Flow (the decode worker drives it; the engine applies each call between steps):

1. ``begin(request)`` takes this worker's prefix hits and allocates blocks for the rest of
   the prompt (including a trailing partial block), then parks the sequence: it holds its
   blocks but is never scheduled. The handle says which of its blocks need KV:
   ``[first_block_to_fill, first_block_to_fill + num_blocks_to_fill)``, i.e. the prefill
   worker runs the prompt with ``export_kv_from_block = first_block_to_fill``.
2. ``complete(request_id, kv, first_token)`` imports the KV into those blocks, marks the
   prompt computed, registers its full blocks in the prefix cache (KvStored), appends the
   first token (stop conditions apply) and hands the sequence to the scheduler for decode.
   A bad ``kv`` raises RemoteKvError and the sequence falls back to local prefill.
3. ``fail(request_id)`` makes the sequence prefill locally, keeping its prefix hits.

Completing or failing a request that is no longer parked (a duplicate, or after an abort)
does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.request import GenerateRequest, TokenOutput
from services.engine.runner.base import ModelRunner
from services.engine.scheduler import Scheduler
from services.engine.sequence import SeqStatus, Sequence


class RemoteKvError(ValueError):
    """Remote KV that does not match what was asked for; the request fell back to local."""


@dataclass(frozen=True, slots=True)
class RemotePrefillHandle:
    """What a decode worker asks a prefill worker to compute and ship back."""

    request_id: str
    num_cached_tokens: int  # prompt tokens this worker already holds (block-aligned)
    first_block_to_fill: int  # = the prefill request's export_kv_from_block
    num_blocks_to_fill: int  # blocks of KV to import: (layers, 2, n, block_size, heads, dim)


def begin(sched: Scheduler, request: GenerateRequest) -> RemotePrefillHandle | None:
    """Park ``request`` with blocks for its whole prompt; None if they do not fit now."""
    sched.validate(request)
    seq = Sequence.from_request(request)
    hit = sched.kv.match_prefix(seq)
    if sched.kv.allocate(seq, seq.num_tokens - hit.num_tokens, hit) is None:
        return None
    sched.count_admission(seq, hit)
    n_hit = len(hit.block_ids)
    seq.status = SeqStatus.PARKED
    seq.remote_fill_from = n_hit
    sched.seqs[request.request_id] = seq
    sched.parked[request.request_id] = seq
    return RemotePrefillHandle(request.request_id, hit.num_tokens, n_hit,
                               len(seq.block_table) - n_hit)


def _problem(runner: ModelRunner, n_blocks: int, kv: Any, first_token: int) -> str | None:
    spec = runner.kv_spec
    expected = spec.block_range_shape(n_blocks)
    shape = getattr(kv, "shape", None)
    if shape is None or tuple(shape) != expected:
        return f"kv shape {None if shape is None else tuple(shape)} != expected {expected}"
    if kv.dtype != spec.dtype:
        return f"kv dtype {kv.dtype} != expected {spec.dtype}"
    if not 0 <= first_token < runner.vocab_size:
        return f"first token {first_token} is outside the vocabulary [0, {runner.vocab_size})"
    return None


def complete(
    sched: Scheduler, runner: ModelRunner, request_id: str, kv: Any, first_token: int
) -> TokenOutput | None:
    """Import a parked request's KV and start decoding it; None if it is not parked."""
    seq = sched.parked.get(request_id)
    if seq is None:
        return None
    blocks = seq.block_table[seq.remote_fill_from :]
    problem = _problem(runner, len(blocks), kv, first_token)
    if problem is None:
        try:
            runner.import_kv(blocks, kv)
        except ValueError as e:
            problem = str(e)
    if problem is not None:
        fail(sched, request_id)
        raise RemoteKvError(f"remote prefill of {request_id!r}: {problem}; "
                            "falling back to local prefill")
    del sched.parked[request_id]
    seq.remote_fill_from = -1
    seq.num_computed_tokens = seq.num_prompt_tokens
    sched.kv.cache_computed_blocks(seq)
    out = sched.append_token(seq, first_token)
    if not out.finished:
        seq.status = SeqStatus.READY
        sched.ready.append(seq)
    return out


def fail(sched: Scheduler, request_id: str) -> bool:
    """Send a parked request to local prefill (first in line), keeping its prefix hits."""
    seq = sched.parked.pop(request_id, None)
    if seq is None:
        return False
    sched.kv.truncate(seq, seq.remote_fill_from)
    seq.remote_fill_from = -1
    seq.status = SeqStatus.WAITING
    # NOTE: it already waited for the remote prefill; it goes first, like a preemption.
    sched.waiting.appendleft(seq)
    return True
