"""Loss spikes from robust rolling statistics.

A spike is a loss far above the recent median in units of the median
absolute deviation (a z-score that one earlier outlier cannot inflate), and
also above a relative and an absolute margin, so the tiny MAD of a flat
late-training loss does not turn noise into spikes. Only upward moves count:
a falling loss is the point of training. Non-finite losses are left to the
numerics detector and never enter the window.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from policies import AnomalyEvent
from workers.detectors.base import event
from workers.stats import StepStats

_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its sigma


@dataclass
class LossSpikeDetector:
    """`loss_spike` when the loss exceeds median + z·σ̂ of the last `window` steps."""

    window: int = 50
    min_history: int = 20
    z_threshold: float = 6.0
    rel_tol: float = 0.25
    abs_tol: float = 0.0
    name: str = "loss_spike"
    _losses: deque[float] = field(default_factory=deque)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        loss = stats.loss
        if not math.isfinite(loss):
            return []
        out: list[AnomalyEvent] = []
        if len(self._losses) >= self.min_history:
            median = statistics.median(self._losses)
            mad = statistics.median(abs(x - median) for x in self._losses)
            sigma = max(_MAD_TO_SIGMA * mad, 1e-12)
            z = (loss - median) / sigma
            margin = max(self.rel_tol * abs(median), self.abs_tol)
            if z > self.z_threshold and loss - median > margin:
                threshold = median + max(self.z_threshold * sigma, margin)
                out.append(
                    event(stats, "loss_spike", value=loss, threshold=threshold, zscore=round(z, 2), median=median)
                )
        if not out:
            # Spikes stay out of the window so one does not mask the next.
            self._losses.append(loss)
            if len(self._losses) > self.window:
                self._losses.popleft()
        return out

    def reset(self) -> None:
        self._losses.clear()
