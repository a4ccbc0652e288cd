"""Small robust statistics and firing discipline shared by the windowed detectors.

Trends are fitted on short series of block summaries (a block median of the
loss, a block minimum of memory), never on raw per-step values: a block
summary shrugs off single outliers, and Theil–Sen over ten or twenty points
costs microseconds where it would cost milliseconds over hundreds.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its sigma


def mad(values: Sequence[float], center: float | None = None) -> float:
    """Median absolute deviation about `center` (the median when not given)."""
    c = statistics.median(values) if center is None else center
    return statistics.median(abs(v - c) for v in values)


def theil_sen_slope(ys: Sequence[float]) -> float:
    """Median of the pairwise slopes of `ys` against 0, 1, 2, ... (O(n²): keep n small)."""
    n = len(ys)
    if n < 2:
        return 0.0
    slopes = [(ys[j] - ys[i]) / (j - i) for i in range(n - 1) for j in range(i + 1, n)]
    return statistics.median(slopes)


def rising_fraction(ys: Sequence[float]) -> float:
    """Share of consecutive pairs that strictly increase (1.0: monotone growth)."""
    if len(ys) < 2:
        return 0.0
    return sum(b > a for a, b in itertools.pairwise(ys)) / (len(ys) - 1)


@dataclass
class Cooldown:
    """Fire at most once per `steps` executed steps (ticks, which never go back).

    A condition that persists would otherwise raise an event every step; the
    policy engine has its own cooldowns, but a detector should not flood it.
    """

    steps: int
    _last: int | None = None

    def ready(self, tick: int) -> bool:
        return self._last is None or tick - self._last >= self.steps

    def fire(self, tick: int) -> None:
        self._last = tick

    def clear(self) -> None:
        self._last = None


@dataclass
class Persistence:
    """A condition that must hold `patience` checks in a row, then fires at most once per cooldown."""

    patience: int
    cooldown_steps: int
    streak: int = 0
    _cooldown: Cooldown = field(init=False)

    def __post_init__(self) -> None:
        self._cooldown = Cooldown(self.cooldown_steps)

    def update(self, condition: bool, tick: int) -> bool:
        """Count this check; True when the detector should raise its event now."""
        self.streak = self.streak + 1 if condition else 0
        if self.streak < self.patience or not self._cooldown.ready(tick):
            return False
        self._cooldown.fire(tick)
        return True

    def reset(self) -> None:
        self.streak = 0
