"""Whether a rank is still learning: its updates applied, zero gradients, a loss scale at its floor.

A run can reach its last step without having learned for the last hundred:
every update skipped by the GradScaler (an overflow storm), gradients that
are identically zero (a loss scale so small that the float16 backward
underflows, a detached loss), or a loss scale stuck below its floor. None of
these raises an exception, and each step looks ordinary on its own.

`LearningTracker` counts those steps over the whole run and keeps the
current streak of steps that learned nothing; `tail_reason()` says why the
last `tail_steps` executed steps were unhealthy, or None. The rank's summary
carries `summary()`, and the run is `degraded` when a rank's tail was
unhealthy (`remedy.control.health`). `LearningDetector` turns the streak
into a `learning_stopped` anomaly for the policy.

Pure: it reads `StepStats` only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from remedy.rank.loop.stats import StepStats

# The loss scale below which updates underflow (the scaler_collapse detector's floor,
# DeepSpeed's and Megatron-LM's minimum loss scale).
SCALE_FLOOR = 1.0
# Steps in a row that learned nothing before the run's tail counts as unhealthy.
TAIL_STEPS = 20

# Why a step learned nothing, most telling first: the words of `tail_reason`.
CAUSES = {
    "skipped": "every update was skipped (overflow, non-finite or out-of-memory steps)",
    "zero_grad": "the gradients were identically zero",
    "scale_floor": "the loss scale stayed below its floor",
}


def step_cause(stats: StepStats, floor: float = SCALE_FLOOR) -> str | None:
    """Why this step learned nothing (a key of `CAUSES`), or None when it learned.

    An update dropped on a command's order (`skip_batches` under the callbacks, whose
    batches are the framework's: `extra["skipped_batch"]`) is a remedy at work: None.
    """
    if stats.extra.get("skipped_batch"):
        return None
    if stats.optimizer_skipped:
        return "skipped"
    if stats.grad_norm == 0.0:
        return "zero_grad"
    if stats.loss_scale is not None and stats.loss_scale < floor:
        return "scale_floor"
    return None


@dataclass
class LearningTracker:
    """Counts one rank's learning over a run (see the module docstring)."""

    tail_steps: int = TAIL_STEPS
    floor: float = SCALE_FLOOR
    steps: int = 0
    updates_applied: int = 0
    updates_skipped: int = 0
    zero_grad_steps: int = 0
    scale_floor_steps: int = 0
    streak: int = 0  # steps in a row that learned nothing, up to now
    _tail: deque[str | None] = field(default_factory=deque)

    def observe(self, stats: StepStats) -> str | None:
        """Count one executed step; its cause of learning nothing, or None."""
        cause = step_cause(stats, self.floor)
        self.steps += 1
        if stats.optimizer_skipped:
            self.updates_skipped += 1
        else:
            self.updates_applied += 1
        self.zero_grad_steps += stats.grad_norm == 0.0
        self.scale_floor_steps += stats.loss_scale is not None and stats.loss_scale < self.floor
        self.streak = self.streak + 1 if cause is not None else 0
        self._tail.append(cause)
        if len(self._tail) > self.tail_steps:
            self._tail.popleft()
        return cause

    def tail_reason(self) -> str | None:
        """Why the last `tail_steps` executed steps learned nothing, or None if one did."""
        if len(self._tail) < self.tail_steps or any(c is None for c in self._tail):
            return None
        causes = [c for c in CAUSES if c in self._tail]
        words = "; ".join(CAUSES[c] for c in causes)
        return f"no learning in the last {self.tail_steps} steps: {words}"

    def summary(self) -> dict[str, Any]:
        """The rank summary's `learning` entry."""
        return {
            "steps": self.steps,
            "updates_applied": self.updates_applied,
            "updates_skipped": self.updates_skipped,
            "zero_grad_steps": self.zero_grad_steps,
            "scale_floor_steps": self.scale_floor_steps,
            "tail_steps": self.tail_steps,
            "unhealthy_tail": self.tail_reason(),
        }
