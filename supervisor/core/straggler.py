"""Stragglers: a rank whose steps take far longer than its peers'.

No rank can see this alone: it is decided from every rank's heartbeats, so
it lives here as a pure function and a small stateful watch the supervisor
calls with `{rank: recent step times}`.

Each rank is summarised by the median of its last `window` step times and
compared with the median of the *other* ranks' summaries (with two ranks,
the other one), so the straggler never drags its own reference up. A rank
whose median exceeds the reference by `ratio` and by `min_excess_s` is
slow; reported when slow on `patience` consecutive checks.

Under synchronous data parallelism every rank waits for the slowest in the
gradient all-reduce, so the wall-clock step times even out. Feed the watch
the time each rank spent *outside* collectives (`step_time_s` minus
`collective_s`, which `CollectiveSlowDetector` adds to the metrics) to see
who is slow, not just that everyone is.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from remedy.policies import AnomalyEvent


def find_stragglers(
    step_times: Mapping[int, Sequence[float]],
    *,
    ratio: float = 1.5,
    min_excess_s: float = 0.05,
    window: int = 20,
    min_samples: int = 5,
) -> dict[int, tuple[float, float]]:
    """`{rank: (its median, the others' median)}` for every rank slower than its peers."""
    medians = {
        rank: statistics.median(times[-window:])
        for rank, times in step_times.items()
        if len(times) >= min_samples
    }
    out: dict[int, tuple[float, float]] = {}
    if len(medians) < 2:
        return out
    # The supervisor checks every step with every rank: sort once, then each rank's
    # reference is the median of the sorted list with its own value taken out.
    ordered = sorted(medians.values())
    for rank, mine in medians.items():
        reference = _median_without(ordered, bisect.bisect_left(ordered, mine))
        if mine > ratio * reference and mine - reference > min_excess_s:
            out[rank] = (mine, reference)
    return out


def _median_without(ordered: list[float], i: int) -> float:
    """`statistics.median` of sorted `ordered` without its item at index `i`."""
    n = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k if k < i else k + 1]

    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2


@dataclass
class StragglerWatch:
    """Turns repeated `find_stragglers` verdicts into `straggler` events, one per episode."""

    ratio: float = 1.5
    min_excess_s: float = 0.05
    window: int = 20
    min_samples: int = 5
    patience: int = 3  # consecutive checks a rank must be slow
    cooldown_checks: int = 60  # checks before the same rank is reported again
    _streak: dict[int, int] = field(default_factory=dict)
    _last_report: dict[int, int] = field(default_factory=dict)
    _checks: int = 0

    def check(
        self, step_times: Mapping[int, Sequence[float]], *, step: int, tick: int | None = None
    ) -> list[AnomalyEvent]:
        """Events for ranks that have been slow for `patience` checks in a row."""
        self._checks += 1
        slow = find_stragglers(
            step_times,
            ratio=self.ratio,
            min_excess_s=self.min_excess_s,
            window=self.window,
            min_samples=self.min_samples,
        )
        out: list[AnomalyEvent] = []
        for rank in list(self._streak):
            if rank not in slow:
                del self._streak[rank]
        for rank, (mine, reference) in sorted(slow.items()):
            self._streak[rank] = self._streak.get(rank, 0) + 1
            last = self._last_report.get(rank)
            if self._streak[rank] < self.patience:
                continue
            if last is not None and self._checks - last < self.cooldown_checks:
                continue
            self._last_report[rank] = self._checks
            out.append(
                AnomalyEvent(
                    kind="straggler",
                    rank=rank,
                    step=step,
                    tick=step if tick is None else tick,
                    value=mine,
                    threshold=self.ratio * reference,
                    severity="warning",
                    source="supervisor",
                    ts=time.time(),
                    details={
                        "peer_median_s": reference,
                        "ratio": round(mine / max(reference, 1e-9), 3),
                    },
                )
            )
        return out

    def reset(self) -> None:
        self._streak.clear()
