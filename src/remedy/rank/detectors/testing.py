"""Helpers for testing detectors, ours and users': step numbers, feeding, guarded runs.

    from remedy.rank.detectors.testing import step_stats, feed, run_guarded

`step_stats` builds a `StepStats` with harmless defaults; `feed` pushes a
sequence of them through a detector and collects its events; `run_guarded`
trains a real model under a `Guard` in single-process mode with an
observe-only policy (every anomaly is only logged, nothing is rolled back,
so the run stays the run you asked for) and chaos faults if given, and
returns every event with its details.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from remedy.policies import AnomalyEvent
from remedy.rank.detectors.base import Detector
from remedy.rank.loop.stats import StepStats

OBSERVE_ONLY_POLICY = """\
version: 1
name: observe-only
description: Log every anomaly; change nothing.
rules:
  - name: log-everything
    when: {severity: info}
    do:
      - notify
"""


def step_stats(step: int = 0, *, tick: int | None = None, **fields: Any) -> StepStats:
    """A `StepStats` for `step` (tick = step unless given); any field may be overridden."""
    values: dict[str, Any] = {
        "rank": 0,
        "loss": 2.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "step_time_s": 0.01,
        "loader_time_s": 0.0,
        "batch_index": step,
    }
    values.update(fields)
    return StepStats(step=step, tick=step if tick is None else tick, **values)


def feed(detector: Detector, stream: Iterable[StepStats]) -> list[AnomalyEvent]:
    """Every event `detector` raises over `stream`, in order."""
    return [e for s in stream for e in detector.observe(s)]


def observe_only_policy(directory: str | Path) -> Path:
    """Write the observe-only policy into `directory`; return its path."""
    path = Path(directory) / "observe-only.yaml"
    path.write_text(OBSERVE_ONLY_POLICY)
    return path


class Recording:
    """Wraps a detector and keeps every event it returns."""

    def __init__(self, inner: Detector) -> None:
        self.inner = inner
        self.name = inner.name
        self.events: list[AnomalyEvent] = []
        inspect = getattr(inner, "inspect_batch", None)
        if callable(inspect):
            self.inspect_batch = inspect
        attach = getattr(inner, "attach", None)
        if callable(attach) and getattr(inner, "model", None) is None:
            self.attach = attach
        # A detector with history keeps it across the run's rollbacks, wrapped or not.
        if callable(getattr(inner, "state_dict", None)):
            self.state_dict = inner.state_dict  # type: ignore[attr-defined]
            self.load_state_dict = inner.load_state_dict  # type: ignore[attr-defined]

    @property
    def warming_up(self) -> bool:
        return bool(getattr(self.inner, "warming_up", False))

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        out = self.inner.observe(stats)
        self.events.extend(out)
        return out

    def reset(self) -> None:
        self.inner.reset()


@dataclass
class GuardedRun:
    events: list[AnomalyEvent]
    stats: list[StepStats] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    def first(self, kind: str) -> AnomalyEvent | None:
        return next((e for e in self.events if e.kind == kind), None)


def run_guarded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    loss_fn: Any,
    data: Any,
    steps: int,
    detectors: Sequence[Detector],
    policy_dir: str | Path,
    scheduler: Any = None,
    scaler: torch.amp.GradScaler | None = None,
    amp_dtype: torch.dtype | None = None,
    faults: Sequence[Any] = (),
    event_sources: Sequence[Any] = (),
    snapshot_every: int = 10,
    grad_clip: float | None = None,
    before_step: Callable[[Any], None] | None = None,
) -> GuardedRun:
    """Train `steps` steps under a Guard (single-process mode, observe-only policy);
    `before_step(guard)` runs in the loop before each step (a rank's own eval, say)."""
    from remedy.rank.guard import Guard, GuardConfig  # noqa: PLC0415
    from remedy.rank.link.context import WorkerContext  # noqa: PLC0415 - avoids an import cycle

    recorders = [Recording(d) for d in detectors]
    config = GuardConfig(
        detectors=list(recorders),
        event_sources=list(event_sources),
        policy=str(observe_only_policy(policy_dir)),
        amp_dtype=amp_dtype,
        snapshot_every=snapshot_every,
        grad_clip=grad_clip,
    )
    guard = Guard(
        model,
        optimizer,
        loss_fn=loss_fn,
        data=data,
        max_steps=steps,
        scheduler=scheduler,
        scaler=scaler,
        config=config,
        context=WorkerContext(faults=list(faults)),
    )
    stats: list[StepStats] = []
    for batch in guard:
        if before_step is not None:
            before_step(guard)
        guard.step(batch)
        stats.append(guard.recent_stats[-1])
    summary = guard.close()
    events = sorted((e for r in recorders for e in r.events), key=lambda e: (e.tick, e.kind))
    return GuardedRun(events, stats, summary)
