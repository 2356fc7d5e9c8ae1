"""The observe-only actuator: the split is what discovery lists, and nothing is applied.
The planner then decides, logs and exports every decision against live traffic without
acting: a policy's dry run, or a deploy with no scaling API the planner may call (compose)."""

from __future__ import annotations

from services.common.discovery import Discovery
from services.planner.decision import Split


class ObserveActuator:
    def __init__(self, discovery: Discovery) -> None:
        self._discovery = discovery

    async def current(self) -> Split:
        prefill = await self._discovery.registrations("prefill")
        decode = await self._discovery.registrations("decode")
        return Split(prefill=len(prefill), decode=len(decode))

    async def apply(self, desired: Split) -> None:
        """Nothing: the decision is only logged and exported (``desired_replicas``)."""
