"""Consistency modes: how far apart workers' steps may be.

- ``async``: no bound (each push is applied as it comes; the default).
- ``ssp:K`` (stale-synchronous parallel, as in Petuum and Angel): no worker starts step
  t + K + 1 before every live worker has finished step t. ``ssp:0`` keeps every worker on
  the same step, each gradient still applied on its own.
- ``sync``: each step, one gradient from every live worker is averaged and applied once;
  every worker computes the next step from the same values (what TensorFlow's
  MirroredStrategy and SyncReplicasOptimizer compute).
"""

from __future__ import annotations

from dataclasses import dataclass

ASYNC, SSP, SYNC = "async", "ssp", "sync"


@dataclass(frozen=True)
class Mode:
    kind: str  # ASYNC, SSP or SYNC
    bound: int = 0  # K of ssp:K

    def __str__(self) -> str:
        return f"ssp:{self.bound}" if self.kind == SSP else self.kind

    @property
    def stepped(self) -> bool:
        """Whether workers take part in steps (join, tagged pushes) in this mode."""
        return self.kind != ASYNC


def parse_mode(text: str, *, what: str = "mode") -> Mode:
    """A mode from its text ("async", "ssp:K" with K >= 0, "sync"); ValueError naming
    `what` (a flag or job key) otherwise."""
    value = (text or "").strip().lower()
    if value in (ASYNC, SYNC):
        return Mode(value)
    if value.startswith("ssp:"):
        bound = value[4:]
        if bound.isdigit():
            return Mode(SSP, int(bound))
    raise ValueError(f"{what} {text!r}: expected async, ssp:K (K an integer >= 0, the steps "
                     "a worker may run ahead of the slowest) or sync")
