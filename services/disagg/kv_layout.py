"""The KV layout a worker sends or receives, announced in discovery (metadata ``kv_layout``)
so that a prefill and a decode worker that could never exchange KV refuse at startup,
naming both layouts, instead of failing (or falling back) on every transfer.

KV crosses the wire in the whole model's layout whatever either side's tensor-parallel
size: a TP entry rank gathers its ranks' KV heads on export and scatters them on import
(services/engine/tp/runner.py). So the TP sizes never block a transfer; what must agree
is everything that shapes a block: layers, KV heads, head size, block size and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

from services.common.discovery import Discovery
from services.disagg.kv_wire import dtype_name

if TYPE_CHECKING:
    import torch

METADATA_KEY = "kv_layout"
PEER_ROLE = {"decode": "prefill", "prefill": "decode"}


class KvShape(Protocol):
    """What shapes a KV block: the engine's ``KvSpec`` has these fields (disagg stays
    apart from the engine; the workers pass their engine's spec)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


class KvLayoutError(RuntimeError):
    """This worker's KV layout cannot be resharded to or from a registered peer's."""


@dataclass(frozen=True, slots=True)
class KvLayout:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    tp: int = 1

    @classmethod
    def of(cls, spec: KvShape, tp: int) -> KvLayout:
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size,
                   dtype_name(spec.dtype), tp)

    def encode(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def parse(cls, text: str) -> KvLayout:
        try:
            kv = dict(item.split("=", 1) for item in text.split())
            return cls(int(kv["layers"]), int(kv["kv_heads"]), int(kv["head_dim"]),
                       int(kv["block_size"]), kv["dtype"], int(kv["tp"]))
        except (KeyError, ValueError) as e:
            raise ValueError(f"not a KV layout: {text!r}") from e

    def reshard_problem(self, other: KvLayout) -> str | None:
        """What stops KV moving between the two layouts (in either direction); None if nothing."""
        differ = [f.name for f in fields(self)
                  if f.name != "tp" and getattr(self, f.name) != getattr(other, f.name)]
        return f"{', '.join(differ)} differ" if differ else None


async def refuse_incompatible_peers(discovery: Discovery, role: str, mine: KvLayout) -> None:
    """Raise KvLayoutError if a registered worker of the peer role has a KV layout this
    one cannot reshard to or from; peers that announce none (mock runners) are skipped."""
    peer_role = PEER_ROLE[role]
    for reg in await discovery.registrations(peer_role):
        text = reg.metadata.get(METADATA_KEY)
        if not text:
            continue
        theirs = KvLayout.parse(text)
        problem = mine.reshard_problem(theirs)
        if problem is not None:
            raise KvLayoutError(
                f"{role} worker refuses to start: its KV layout [{mine.encode()}] cannot be "
                f"resharded to or from {peer_role} worker {reg.instance_id}'s [{theirs.encode()}] "
                f"({problem})")
