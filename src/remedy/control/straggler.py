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
who is slow, not just that everyone is. The time a rank waited for a peer's
own phase before the step (`phase_wait_s`: an eval or a save on that peer,
`rank.loop.phases`) is waiting too, where no collective was timed; a phase
itself never enters a step's time, so the rank in it is no straggler.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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


@dataclass(slots=True)
class _RankTimes:
    """One rank's recent compute times and the newest step they reach."""

    times: deque[float]
    step: int
    tick: int


class StepTimes:
    """Each rank's recent compute times, fed from its step records, for a `StragglerWatch`.

    The watch runs once per distinct newest step across ranks (`check`), not
    per batch: ranks sit at a few distinct steps, counted as they move, so
    finding the newest is no max over every rank.
    """

    def __init__(self, watch: StragglerWatch) -> None:
        self.watch = watch
        self._times: dict[int, _RankTimes] = {}
        self._newest_steps: Counter[int] = Counter()  # ranks at each `_RankTimes.step`
        self._len = max(watch.window, watch.min_samples)
        self.fresh = False  # samples arrived since the last check
        self._checked_step: int | None = None  # the newest step at the last check

    def add(self, rank: int, record: dict[str, Any]) -> None:
        """Keep the record's compute time; skip it if malformed."""
        step = record.get("step")
        seconds = seconds_of(record.get("step_time_s"))
        if type(step) is not int or seconds is None:
            return
        waited = record.get("collective_s")
        if waited is not None:
            waited = seconds_of(waited)
            if waited is None:
                return
        phase_wait = record.get("phase_wait_s")
        if phase_wait is not None:
            phase_wait = seconds_of(phase_wait)
            if phase_wait is None:
                return
            # The timed collectives hold the wait for the peer's phase already, if any were.
            waited = max(waited or 0.0, phase_wait)
        if waited is not None:
            # Under synchronous DDP every rank waits in the all-reduce for the
            # slowest, so wall step times even out; the time outside collectives
            # tells who is slow. Bucket all-reduces can overlap, so their sum may
            # pass the wall time: that rank spent its whole step waiting.
            seconds = max(seconds - waited, 0.0)
        tick = record.get("tick")
        if type(tick) is not int:
            tick = step
        times = self._times.get(rank)
        if times is None or tick < times.tick:
            # Ticks only grow within a process: a smaller one is a restarted rank,
            # whose history describes a process that is gone.
            if times is not None:
                self._uncount(times.step)
            times = self._times[rank] = _RankTimes(deque(maxlen=self._len), step, tick)
            self._newest_steps[step] += 1
        times.times.append(seconds)
        # The newest record, not the largest step: steps go back after a rollback.
        if times.step != step:
            self._uncount(times.step)
            self._newest_steps[step] += 1
        times.step, times.tick = step, tick
        self.fresh = True

    def check(self) -> list[AnomalyEvent]:
        """The watch's verdict once per distinct newest step; [] otherwise."""
        self.fresh = False
        newest = max(self._newest_steps, default=None)
        if newest is None or newest == self._checked_step:
            return []
        self._checked_step = newest
        # Stamped with the step every rank has reached, so the event is not ahead of any.
        return self.watch.check(
            {rank: list(t.times) for rank, t in self._times.items()},
            step=min(t.step for t in self._times.values()),
            tick=min(t.tick for t in self._times.values()),
        )

    def forget(self, rank: int) -> None:
        """Drop a rank's history (a replaced rank is a new process)."""
        times = self._times.pop(rank, None)
        if times is not None:
            self._uncount(times.step)

    def newest_steps(self) -> Counter[int]:
        """How many ranks sit at each newest step (for tests of the bookkeeping)."""
        return Counter(self._newest_steps)

    def steps(self) -> list[int]:
        """Each rank's newest step, in rank order of arrival."""
        return [t.step for t in self._times.values()]

    def _uncount(self, step: int) -> None:
        self._newest_steps[step] -= 1
        if not self._newest_steps[step]:
            del self._newest_steps[step]


def seconds_of(value: Any) -> float | None:
    """A duration from untrusted input: a finite, non-negative number, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return seconds if 0.0 <= seconds < math.inf else None  # NaN fails both
