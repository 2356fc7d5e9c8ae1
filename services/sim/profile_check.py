"""The verdict of `tandem sim profile --check`: how far a step-time profile is from the
steps the same engine takes on this machine now. ``--check --json FILE`` writes it and
`tandem sim calibrate`, which runs the check in a process of its own, reads it back.

Kept free of torch and the engine: calibrate's own process never builds one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from services.steptime.model import BatchShape

_SHAPE = tuple(f.name for f in fields(BatchShape))


@dataclass(frozen=True, slots=True)
class CheckedStep:
    """One step timed now (``seconds``, the median of its repeats) beside what the profile
    says it takes (``profile_seconds``)."""

    shape: BatchShape
    seconds: float
    profile_seconds: float

    @property
    def error(self) -> float:
        """The profile's relative error, signed: below 0 when it is faster than now."""
        return self.profile_seconds / self.seconds - 1


@dataclass(frozen=True, slots=True)
class ProfileCheck:
    """``profile``: the profile's path; ``mean_error``, ``max_error``: ``|profile - now| /
    now`` over ``points``; ``stale``: past the tolerance (services/sim/profiler.py
    ``is_stale``), the profile no longer describes this machine."""

    profile: str
    mean_error: float
    max_error: float
    stale: bool
    points: tuple[CheckedStep, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile, "mean_error": self.mean_error,
                "max_error": self.max_error, "stale": self.stale,
                "points": [{**asdict(p.shape), "seconds": p.seconds,
                            "profile_seconds": p.profile_seconds} for p in self.points]}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ProfileCheck:
        """What ``to_json`` wrote (other keys, the command line and machine, are skipped);
        KeyError or ValueError when a field is missing or not a number."""
        points = tuple(CheckedStep(BatchShape(**{k: int(q[k]) for k in _SHAPE}), float(q["seconds"]),
                                   float(q["profile_seconds"])) for q in doc["points"])
        if not isinstance(doc["stale"], bool):
            raise ValueError(f"stale is {doc['stale']!r}, not true or false")
        return cls(str(doc["profile"]), float(doc["mean_error"]), float(doc["max_error"]),
                   doc["stale"], points)
