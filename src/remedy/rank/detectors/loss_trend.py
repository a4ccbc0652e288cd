"""Slow loss trouble: a sustained rise (divergence) and noise with no progress (oscillation).

Both look at the loss over a long window summarised in blocks: every
`block` finite losses become one block median, so a spike or two never moves
a block, and the work happens once per block, not once per step. A verdict
must hold for `patience` consecutive blocks before it becomes an event: one
bad block is what spikes are for.

- Divergence: the latest block median stands more than `rise_rel` (and
  `rise_abs`) above the lowest block median of the window, and more than
  `noise_z` standard errors of a block median (from the scatter within
  blocks), and the robust (Theil–Sen) slope of the window's block medians
  is upward. This catches a slow creep as well as a jump to a level that
  does not come back down. The noise term is what keeps a noisy small job
  quiet: with batches of 32 a classifier's or a regression's per-batch loss
  scatters by 20-25% of its level, its block medians by ~7%, and the
  highest of ten of them stands 15-25% above the lowest with no trend at
  all (up to 4.3 standard errors in the clean runs of `examples/loops`).
- Oscillation: the loss scatters widely within its blocks (1.4826 times the
  median absolute deviation from each block's median, above `spread_rel` of
  the window median), `growth` times more than it ever did in the earlier
  windows of the run, while the block medians' robust trend does not fall by
  more than `progress_rel` over the window: the optimizer is bouncing, not
  descending. Scatter is measured within blocks so that a level shift (a
  jump that stays) counts as divergence, not oscillation. The comparison
  with the run's own past is the point: how much a batch's loss scatters
  is a property of the job (batch size, label noise), and a converged small
  classifier with batches of 32 scatters by 20-25% of its level for
  ever, every window no more than 1.1x the highest before it, where a
  source turning to garbage multiplies the scatter 3.5x within one window.
  Windows judged oscillating do not raise that reference. The scatter
  of the first full window is the first reference: a run bouncing from its
  first step on is not reported.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from remedy.policies import AnomalyEvent
from remedy.rank.detectors._robust import MAD_TO_SIGMA, Persistence, theil_sen_slope
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats

# The standard error of the median of n normal draws is this times sigma / sqrt(n).
_MEDIAN_EFFICIENCY = math.sqrt(math.pi / 2)


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

    def state(self) -> dict[str, Any]:
        """The closed blocks' raw values and the open block's (their medians follow)."""
        return {"blocks": [list(b) for b in self.values], "current": list(self._current)}

    def load(self, state: dict[str, Any]) -> None:
        blocks = [[float(x) for x in b] for b in state["blocks"]][-self.keep :]
        self.values = deque(blocks)
        self.medians = deque(statistics.median(b) for b in blocks)
        self._current = [float(x) for x in state["current"]]


def _median_error(meds: list[float], blocks: Iterable[list[float]], size: int) -> float:
    """Standard error of a block median, from the robust scatter within the blocks."""
    deviations = [abs(x - m) for m, blk in zip(meds, blocks, strict=True) for x in blk]
    sigma = MAD_TO_SIGMA * statistics.median(deviations)
    return _MEDIAN_EFFICIENCY * sigma / math.sqrt(size)


@dataclass
class LossDivergenceDetector:
    """`loss_divergence`: the loss stays well above its window minimum and trends upward."""

    block: int = 20  # steps per block median
    window_blocks: int = 10  # the window: 200 steps by default
    min_blocks: int = 5  # blocks needed before any verdict
    rise_rel: float = 0.15  # latest block median above the window minimum by this share...
    rise_abs: float = 0.0  # ...and by at least this much
    noise_z: float = 6.0  # ...and by this many standard errors of a block median
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
        diverging = (
            rise > max(self.rise_rel * abs(low), self.rise_abs)
            and slope > 0
            and rise > self.noise_z * _median_error(meds, self._blocks.values, self.block)
        )
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

    @property
    def warming_up(self) -> bool:
        """Fewer than `min_blocks` block medians: no verdict yet."""
        return len(self._blocks.medians) < self.min_blocks

    def state_dict(self) -> dict[str, Any]:
        """The blocks of the window."""
        return self._blocks.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The blocks back to `state` (a snapshot's); the patience streak starts over."""
        self._blocks.load(state)
        self._gate.reset()

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
    growth: float = 1.5  # scatter this many times the highest of the earlier windows
    patience: int = 2
    cooldown_steps: int = 200
    name: str = "loss_oscillation"
    _blocks: _Blocks = field(init=False)
    _gate: Persistence = field(init=False)
    # Highest scatter of the run's windows not judged oscillating. Kept across a
    # rollback: the replay is the same job, with the same batch noise.
    _reference: float | None = field(default=None, init=False)

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
        reference = self._reference
        oscillating = (
            spread > self.spread_rel
            and fall < self.progress_rel
            and reference is not None
            and spread > self.growth * reference
        )
        if not oscillating:
            # The job's own scatter so far; a bouncing window must not raise it.
            self._reference = spread if reference is None else max(reference, spread)
        if not self._gate.update(oscillating, stats.tick):
            return []
        return [
            event(
                stats,
                "loss_oscillation",
                value=spread,
                threshold=self.spread_rel,
                median=center,
                reference_spread=reference,
                trend_change_rel=-fall,
                blocks=self._gate.streak,
            )
        ]

    @property
    def warming_up(self) -> bool:
        """No full window yet: no verdict."""
        return len(self._blocks.medians) < self.window_blocks

    def state_dict(self) -> dict[str, Any]:
        """The blocks of the window and the reference scatter of the run so far."""
        return {**self._blocks.state(), "reference": self._reference}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The blocks and the reference back to `state`; the patience streak starts over."""
        self._blocks.load(state)
        ref = state.get("reference")
        self._reference = None if ref is None else float(ref)
        self._gate.reset()

    def reset(self) -> None:
        self._blocks.clear()
        self._gate.reset()
