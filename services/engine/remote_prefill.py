"""The decode side's remote-prefill contract: the handle, the error, what the runner offers.

The flow itself lives on the scheduler, which owns every sequence's state
(``Scheduler.begin_remote_prefill`` / ``complete_remote_prefill`` / ``fail_remote_prefill``):

1. begin parks the request with blocks for its whole prompt; the handle says which blocks
   need KV: ``[first_block_to_fill, first_block_to_fill + num_blocks_to_fill)``, i.e. the
   prefill worker runs the prompt with ``export_kv_from_block = first_block_to_fill``.
2. complete imports the KV into those blocks and starts decoding; a bad ``kv`` raises
   RemoteKvError and the sequence falls back to local prefill.
3. fail makes the sequence prefill locally, keeping its prefix hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from services.engine.runner.base import KvSpec


class RemoteKvError(ValueError):
    """Remote KV that does not match what was asked for; the request fell back to local."""


@dataclass(frozen=True, slots=True)
class RemotePrefillHandle:
    """What a decode worker asks a prefill worker to compute and ship back."""

    request_id: str
    num_cached_tokens: int  # prompt tokens this worker already holds (block-aligned)
    first_block_to_fill: int  # = the prefill request's export_kv_from_block
    num_blocks_to_fill: int  # blocks of KV to import: (layers, 2, n, block_size, heads, dim)


class KvImporter(Protocol):
    """The runner's side of an import (a ModelRunner is one)."""

    kv_spec: KvSpec

    def import_kv(self, block_ids: Sequence[int], data: Any) -> None: ...


def remote_kv_problem(spec: KvSpec, vocab_size: int, n_blocks: int, kv: Any,
                      first_token: int) -> str | None:
    """Why ``kv`` and ``first_token`` cannot fill ``n_blocks`` blocks; None if they can."""
    expected = spec.block_range_shape(n_blocks)
    shape = getattr(kv, "shape", None)
    if shape is None or tuple(shape) != expected:
        return f"kv shape {None if shape is None else tuple(shape)} != expected {expected}"
    if kv.dtype != spec.dtype:
        return f"kv dtype {kv.dtype} != expected {spec.dtype}"
    if not 0 <= first_token < vocab_size:
        return f"first token {first_token} is outside the vocabulary [0, {vocab_size})"
    return None
