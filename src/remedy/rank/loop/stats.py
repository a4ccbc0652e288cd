"""The numbers the Guard measures for one step, shared by every detector."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StepStats:
    """One executed step on one rank.

    `step` is the logical step (it goes back after a rollback); `tick` counts
    executed steps and only grows. Values that a configuration does not
    measure stay `None` so detectors can tell "absent" from "zero".
    """

    step: int
    tick: int
    rank: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    loader_time_s: float
    batch_index: int
    loss_scale: float | None = None
    scaler_skipped: bool = False
    mem_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    mem_capacity_bytes: int | None = None
    optimizer_skipped: bool = False
    # The bound the global norm was clipped to before the update (None: no clipping).
    grad_clip: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Wall time (seconds since the epoch) the step ended: stats are built as it ends. The
    # supervisor's goodput ledger reads where the time between steps went from it.
    ended_at: float = field(default_factory=time.time)

    def to_metrics(self) -> dict[str, Any]:
        """The `metrics.jsonl` record (non-finite floats as strings: JSON has no NaN)."""
        out: dict[str, Any] = {
            "step": self.step,
            "tick": self.tick,
            "rank": self.rank,
            "loss": _jsonable(self.loss),
            "grad_norm": _jsonable(self.grad_norm),
            "lr": self.lr,
            "loss_scale": self.loss_scale,
            "step_time_s": round(self.step_time_s, 6),
            "loader_time_s": round(self.loader_time_s, 6),
            "mem_bytes": self.mem_bytes,
            "batch_index": self.batch_index,
            "optimizer_skipped": self.optimizer_skipped,
            "t_end": round(self.ended_at, 4),
        }
        out.update(self.extra)
        return out


def _jsonable(x: float) -> float | str:
    return x if x == x and abs(x) != float("inf") else str(x)
