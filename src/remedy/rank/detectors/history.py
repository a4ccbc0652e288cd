"""Detector history as part of the training state at a step.

A detector that judges a step against the run's own past (a loss level, a
gradient-norm median, block medians, a window of scaler skips) keeps that
past as its history. The history belongs to the timeline, like the weights:
a snapshot captures it (`state_dict()`, plain numbers, no tensors), and a
rollback, an adoption of a peer's state after a rank restart, and a resume
from a durable checkpoint restore it with the weights
(`load_state_dict(state)`), so after any of them a detector judges the next
step exactly as it would have without the recovery. `reset()` is kept for a
genuinely new run.

A detector without `state_dict` measures the process rather than the
timeline (memory, loader waits, collective timings, the weights sampled by
the update-stall detector, the batches the duplicate index has seen): it is
reset when state is restored and refills its window from the restored step.

A detector with a `warming_up` property says whether it cannot judge with
its history yet (a new run's first steps); `WarmupNotice` turns changes of
that set into one informational entry of the metrics record.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def _keys(detectors: Sequence[Any]) -> list[str]:
    """One key per detector: its name, with `#n` for the n-th repeat of a name."""
    seen: dict[str, int] = {}
    out = []
    for d in detectors:
        n = seen.get(d.name, 0)
        seen[d.name] = n + 1
        out.append(d.name if n == 0 else f"{d.name}#{n + 1}")
    return out


def capture(detectors: Sequence[Any]) -> dict[str, Any]:
    """The history of every detector that keeps one, by key (plain numbers, a fresh copy)."""
    return {
        key: d.state_dict()
        for key, d in zip(_keys(detectors), detectors, strict=True)
        if callable(getattr(d, "state_dict", None))
    }


def restore(detectors: Sequence[Any], state: dict[str, Any] | None) -> None:
    """Put every detector's history back to `state` (`capture`'s); reset those it lacks.

    `None` (a snapshot taken without histories, such as an older checkpoint's)
    resets every detector.
    """
    saved = state or {}
    for key, d in zip(_keys(detectors), detectors, strict=True):
        load = getattr(d, "load_state_dict", None)
        if callable(load) and key in saved:
            load(saved[key])
        else:
            d.reset()


def warming(detectors: Iterable[Any]) -> list[str]:
    """Names of the detectors that cannot judge with their history yet."""
    return [d.name for d in detectors if getattr(d, "warming_up", False)]


class WarmupNotice:
    """Says, once each time it changes, which detectors are still warming up.

    `changed(detectors)` returns the names warming up now when the set differs
    from the last one said (the first step of a run with any warming up, and the
    step the last one is ready: an empty list), else None.
    """

    def __init__(self) -> None:
        self._said: list[str] = []

    def changed(self, detectors: Iterable[Any]) -> list[str] | None:
        now = warming(detectors)
        if now == self._said:
            return None
        self._said = now
        return now
