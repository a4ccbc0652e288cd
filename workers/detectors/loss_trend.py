"""Slow loss trouble: a sustained rise (divergence) and noise with no progress (oscillation).

Both look at the loss over a long window summarised in blocks: every
`block` finite losses become one block median, so a spike or two never moves
a block, and the work happens once per block, not once per step. A verdict
must hold for `patience` consecutive blocks before it becomes an event: one
bad block is what spikes are for.

- Divergence: the latest block median stands more than `rise_rel` (and
  `rise_abs`) above the lowest block median of the window, and the robust
  (Theil–Sen) slope of the window's block medians is upward. This catches a
  slow creep as well as a jump to a level that does not come back down.
- Oscillation: the loss scatters widely within its blocks (1.4826 times the
  median absolute deviation from each block's median, above `spread_rel` of
  the window median) while the block medians' robust trend does not fall by
  more than `progress_rel` over the window: the optimizer is bouncing, not
  descending. Scatter is measured within blocks so that a level shift (a
  jump that stays) counts as divergence, not oscillation.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from remedy.policies import AnomalyEvent
from remedy.workers.detectors._robust import MAD_TO_SIGMA, Persistence, theil_sen_slope
from remedy.workers.detectors.base import event
from remedy.workers.stats import StepStats


@dataclass
class _Blocks:
    """Block medians of a finite series, plus the raw values of the blocks kept."""

    block: int
    keep: int
    medians: deque[float] = field(default_factory=deque)
    values: deque[list[float]] = field(default_factory=deque)
    _current: list[float] = field(default_factory=list)

    def add(self, x: float) -> bool:
        """Add a value; True when it closed a block."""
        self._current.append(x)
        if len(self._current) < self.block:
            return False
        self.medians.append(statistics.median(self._current))
        self.values.append(self._current)
        self._current = []
        if len(self.medians) > self.keep:
            self.medians.popleft()
            self.values.popleft()
        return True

    def clear(self) -> None:
        self.medians.clear()
        self.values.clear()
        self._current = []


@dataclass
class LossDivergenceDetector:
    """`loss_divergence`: the loss stays well above its window minimum and trends upward."""

    block: int = 20  # steps per block median
    window_blocks: int = 10  # the window: 200 steps by default
    min_blocks: int = 5  # blocks needed before any verdict
    rise_rel: float = 0.15  # latest block median above the window minimum by this share...
    rise_abs: float = 0.0  # ...and by at least this much
    patience: int = 3  # consecutive diverging blocks before the event
    cooldown_steps: int = 200
    name: str = "loss_divergence"
    _blocks: _Blocks = field(init=False)
    _gate: Persistence = field(init=False)

    def __post_init__(self) -> None:
        self._blocks = _Blocks(self.block, self.window_blocks)
        self._gate = Persistence(self.patience, self.cooldown_steps)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        if not math.isfinite(stats.loss) or not self._blocks.add(stats.loss):
            return []
        meds = list(self._blocks.medians)
        if len(meds) < self.min_blocks:
            return []
        low, last = min(meds), meds[-1]
        rise = last - low
        slope = theil_sen_slope(meds)
        diverging = rise > max(self.rise_rel * abs(low), self.rise_abs) and slope > 0
        if not self._gate.update(diverging, stats.tick):
            return []
        return [
            event(
                stats,
                "loss_divergence",
                value=last,
                threshold=low + max(self.rise_rel * abs(low), self.rise_abs),
                window_min=low,
                slope_per_step=slope / self.block,
                blocks=self._gate.streak,
            )
        ]

    def reset(self) -> None:
        self._blocks.clear()
        self._gate.reset()


@dataclass
class LossOscillationDetector:
    """`loss_oscillation`: wide step-to-step scatter while the trend is not going down."""

    block: int = 20
    window_blocks: int = 10  # full window needed: 200 steps by default
    spread_rel: float = 0.2  # robust within-block sigma above this share of the median
    progress_rel: float = 0.05  # the trend may fall at most this share over the window
    patience: int = 2
    cooldown_steps: int = 200
    name: str = "loss_oscillation"
    _blocks: _Blocks = field(init=False)
    _gate: Persistence = field(init=False)

    def __post_init__(self) -> None:
        self._blocks = _Blocks(self.block, self.window_blocks)
        self._gate = Persistence(self.patience, self.cooldown_steps)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        if not math.isfinite(stats.loss) or not self._blocks.add(stats.loss):
            return []
        if len(self._blocks.medians) < self.window_blocks:
            return []
        meds = list(self._blocks.medians)
        center = statistics.median(meds)
        # Scatter within blocks (about each block's own median), so a level
        # shift between blocks is not mistaken for noise.
        deviations = [
            abs(x - m) for m, blk in zip(meds, self._blocks.values, strict=True) for x in blk
        ]
        spread = MAD_TO_SIGMA * statistics.median(deviations) / max(abs(center), 1e-12)
        fall = -theil_sen_slope(meds) * (len(meds) - 1) / max(abs(center), 1e-12)
        oscillating = spread > self.spread_rel and fall < self.progress_rel
        if not self._gate.update(oscillating, stats.tick):
            return []
        return [
            event(
                stats,
                "loss_oscillation",
                value=spread,
                threshold=self.spread_rel,
                median=center,
                trend_change_rel=-fall,
                blocks=self._gate.streak,
            )
        ]

    def reset(self) -> None:
        self._blocks.clear()
        self._gate.reset()
