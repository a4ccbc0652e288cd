"""The input pipeline cannot keep up: steps wait longer for data than they compute.

The Guard times the wait for each batch (`loader_time_s`) apart from the
step itself (`step_time_s`). Their ratio over a short window says whether
the accelerator is being starved: above `warn_ratio` the job spends more
time waiting than computing; above `critical_ratio` it runs at well under
half speed. Medians over `window` steps keep one slow batch (a cold cache,
a shard boundary) from firing; `min_wait_s` keeps microsecond waits on tiny
steps from counting as stalls. A stall must also last: the window that
shows it and the stalled steps after it must add up to `min_stall_s` of
training time. Five steps of a small CPU job are a few milliseconds, and on
a busy machine the scheduler's preemptions (a few ms each) land in the
loader often enough that one such window in thousands reads as a stall; a
loader that is really too slow stays slow, and a stall of slow steps (a
0.1 s wait) is still reported at the third slow batch.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from remedy.policies import AnomalyEvent
from remedy.rank.detectors._robust import Cooldown
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats


@dataclass
class DataStallDetector:
    """`data_stall`: median loader wait / median step time above 1.0 (warning) or 2.5 (critical);
    or one wait of at least `min_spike_s` and `spike_ratio` median steps (warning)."""

    window: int = 5
    # A wait as long as the step's compute halves the throughput.
    warn_ratio: float = 1.0
    critical_ratio: float = 2.5
    min_wait_s: float = 0.005
    min_stall_s: float = 0.25  # training time (waits and steps) the stall must have lasted
    # One long wait: a shard that took seconds to open stalls the job as much as a slow
    # window, though the median never sees it.
    spike_ratio: float = 3.0
    min_spike_s: float = 1.0
    cooldown_steps: int = 100
    name: str = "data_stall"
    _waits: deque[float] = field(default_factory=deque)
    _steps: deque[float] = field(default_factory=deque)
    _warn: Cooldown = field(init=False)
    _critical: Cooldown = field(init=False)
    _spike: Cooldown = field(init=False)
    _stalled_s: float = 0.0  # time covered by the current run of stalled windows

    def __post_init__(self) -> None:
        self._warn = Cooldown(self.cooldown_steps)
        self._critical = Cooldown(self.cooldown_steps)
        self._spike = Cooldown(self.cooldown_steps)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        self._waits.append(stats.loader_time_s)
        self._steps.append(stats.step_time_s)
        if len(self._waits) > self.window:
            self._waits.popleft()
            self._steps.popleft()
        if len(self._waits) < self.window:
            return []
        spike = self._one_long_wait(stats)
        if spike:
            return spike
        wait = statistics.median(self._waits)
        if wait < self.min_wait_s:
            self._stalled_s = 0.0
            return []
        ratio = wait / max(statistics.median(self._steps), 1e-9)
        if ratio > self.critical_ratio:
            severity, threshold, gate = "critical", self.critical_ratio, self._critical
        elif ratio > self.warn_ratio:
            severity, threshold, gate = "warning", self.warn_ratio, self._warn
        else:
            self._stalled_s = 0.0
            return []
        if self._stalled_s == 0.0:  # the window that first shows the stall counts whole
            self._stalled_s = sum(self._waits) + sum(self._steps)
        else:
            self._stalled_s += stats.loader_time_s + stats.step_time_s
        if self._stalled_s < self.min_stall_s or not gate.ready(stats.tick):
            return []
        gate.fire(stats.tick)
        if severity == "critical":
            self._warn.fire(stats.tick)  # a warning right after a critical says nothing new
        return [
            event(
                stats,
                "data_stall",
                value=ratio,
                threshold=threshold,
                severity=severity,
                loader_s=wait,
                step_s=statistics.median(self._steps),
            )
        ]

    def reset(self) -> None:
        self._waits.clear()
        self._steps.clear()
        self._stalled_s = 0.0

    def _one_long_wait(self, stats: StepStats) -> list[AnomalyEvent]:
        wait = stats.loader_time_s
        if wait < self.min_spike_s:
            return []
        step_s = statistics.median(self._steps)
        ratio = wait / max(step_s, 1e-9)
        if ratio < self.spike_ratio or not self._spike.ready(stats.tick):
            return []
        self._spike.fire(stats.tick)
        return [
            event(
                stats,
                "data_stall",
                value=ratio,
                threshold=self.spike_ratio,
                severity="warning",
                loader_s=wait,
                step_s=step_s,
                single_wait=True,
            )
        ]
