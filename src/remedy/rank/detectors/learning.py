"""`learning_stopped`: a streak of steps that learned nothing.

A step learns nothing when its update was skipped, its gradients were
identically zero, or its loss scale sat below the floor where float16
gradients underflow (`remedy.rank.loop.learning.step_cause`). Any one such
step is ordinary; `patience` (20) in a row is a run that has stopped
learning, whatever the cause, and the detector fires then and again every
`patience` steps while the streak lasts, so a policy can escalate rung by
rung (rescue the scale, roll back, stop) instead of hearing it once. It is
critical: a `notify` alone leaves a dead run running.

`grad_norm_vanishing` stays what it was (a tiny norm for a few steps, an
informational hint); this detector is the one a policy acts on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from remedy.policies import AnomalyEvent
from remedy.rank.detectors.base import event
from remedy.rank.loop.learning import CAUSES, LearningTracker
from remedy.rank.loop.stats import StepStats


@dataclass
class LearningDetector:
    """Fires `learning_stopped` after `patience` steps in a row that learned nothing."""

    patience: int = 20
    name: str = "learning"
    _tracker: LearningTracker = field(init=False)
    _causes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._tracker = LearningTracker(tail_steps=self.patience)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        cause = self._tracker.observe(stats)
        if cause is None:
            self._causes.clear()
            return []
        self._causes[cause] = self._causes.get(cause, 0) + 1
        streak = self._tracker.streak
        if streak % self.patience:
            return []
        # The cause the streak is made of most (ties: the most telling, CAUSES's order).
        main = max(CAUSES, key=lambda c: (self._causes.get(c, 0), -list(CAUSES).index(c)))
        return [
            event(
                stats,
                "learning_stopped",
                value=float(streak),
                threshold=float(self.patience),
                severity="critical",
                cause=main,
                why=f"{streak} steps in a row learned nothing: {CAUSES[main]}",
                loss_scale=stats.loss_scale,
            )
        ]

    def reset(self) -> None:
        """After a rollback the restored timeline starts a new streak."""
        self._tracker.streak = 0
        self._causes.clear()
