"""The detector plug-in shape: one small object, one call per step.

A detector sees the `StepStats` of each executed step and returns the
anomalies it found (usually none). A detector that needs the batch itself
(padding share, near-duplicates) may also define `inspect_batch(batch)`,
which the Guard calls when the batch is fetched, before the step. Detectors keep their own rolling state.
One whose state is the timeline's history (a loss level, a norm median) also
defines `state_dict()` / `load_state_dict(state)`: a snapshot carries it, and a
rollback or an adoption restores it with the weights (`detectors.history`), so
a window never mixes the abandoned timeline with the restored one and is
never emptied by a recovery. `reset()` forgets everything: a new run, or a
detector without history restored. They must be cheap: they run every step on
numbers the Guard already brought to the host.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from remedy.policies import AnomalyEvent
from remedy.rank.detectors import history
from remedy.rank.loop.stats import StepStats


@runtime_checkable
class Detector(Protocol):
    """Anything with a `name`, `observe(stats)` and `reset()`."""

    name: str

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        """Events for this step; an empty list when all is well."""
        ...

    def reset(self) -> None:
        """Forget rolling state (a new run; after a restore, a detector without `state_dict`)."""
        ...


def event(
    stats: StepStats,
    kind: str,
    *,
    value: float | None,
    threshold: float | None,
    severity: str = "warning",
    **details: Any,
) -> AnomalyEvent:
    """Build an event stamped with the step's rank, step and tick."""
    return AnomalyEvent(
        kind=kind,
        rank=stats.rank,
        step=stats.step,
        tick=stats.tick,
        value=value,
        threshold=threshold,
        severity=severity,
        source="detector",
        ts=time.time(),
        details=details,
    )


class DetectorSuite:
    """Runs a list of detectors in order and gathers their events."""

    def __init__(self, detectors: Iterable[Detector]) -> None:
        self.detectors: list[Detector] = list(detectors)
        # The detectors' `flags` methods, found once per list of detectors (see `flags`).
        self._flaggers: tuple[list[Detector], list[Any]] = ([], [])
        self._warmup = history.WarmupNotice()

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        out: list[AnomalyEvent] = []
        for detector in self.detectors:
            out.extend(detector.observe(stats))
        return out

    def reset(self) -> None:
        """Forget every detector's history: a new run."""
        for detector in self.detectors:
            detector.reset()

    def state_dict(self) -> dict[str, Any]:
        """The detectors' histories, for a snapshot (`detectors.history.capture`)."""
        return history.capture(self.detectors)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Histories back to a snapshot's; detectors without one are reset (`history.restore`)."""
        history.restore(self.detectors, state)

    def warming(self) -> list[str]:
        """Names of the detectors that cannot judge with their history yet."""
        return history.warming(self.detectors)

    def warming_changed(self) -> list[str] | None:
        """`warming()` when it differs from the last time this said it, else None (the
        metrics record's `detectors_warming`: said at a run's first step, and when ready)."""
        return self._warmup.changed(self.detectors)

    def flags(self, loss: float, grad_norm: float, *, scaled: bool) -> bool:
        """Whether a detector will report this step's loss or gradient norm, asked before the
        optimizer step (detectors that can tell define `flags(loss, grad_norm, scaled=...)`).

        `scaled`: an enabled GradScaler scaled the loss (inf gradients are then its
        overflow signal, not an anomaly). The Guard keeps the state from before such
        a step, so that `replay_step` can re-run it (`workers.replay`).
        """
        seen, flaggers = self._flaggers
        current = self.detectors
        if len(seen) != len(current) or any(a is not b for a, b in zip(seen, current, strict=True)):
            flaggers = [d.flags for d in self.detectors if callable(getattr(d, "flags", None))]  # type: ignore[attr-defined]
            self._flaggers = (list(self.detectors), flaggers)
        return any(ask(loss, grad_norm, scaled=scaled) for ask in flaggers)

    def new_epoch(self, epoch: int) -> None:
        """Tell the detectors that care (`new_epoch(epoch)`) that a new pass over the data began."""
        for detector in self.detectors:
            hook = getattr(detector, "new_epoch", None)
            if callable(hook):
                hook(epoch)

    def names(self) -> Sequence[str]:
        return [d.name for d in self.detectors]
