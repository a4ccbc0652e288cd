"""Loss spikes: a loss far above the current level, in units of the step-to-step noise.

The level is the median of the last `level_window` losses, so it follows
the downward trend of training. The noise scale comes from the successive
differences over the last `window` losses (their MAD, as a sigma, over √2):
a trend barely moves differences, so early in training, while the loss
falls fast, the scale stays that of the noise and a spike still stands out,
where a z-score against the window's own spread would drown it in the trend.
A spike must also clear a relative and an absolute margin above the level,
so the tiny noise of a flat late-training loss does not turn wobbles into
spikes. Only upward moves count: a falling loss is the point of training.
Non-finite losses are left to the numerics detector and never enter the
window, and neither do spikes, so one does not mask the next.

The window is the timeline's history (`detectors.history`): a snapshot
carries it and a rollback or an adoption restores it. Before `min_history`
losses (a new run's first steps) the detector says it is warming up and
judges against its warm-up bounds instead: a loss above `loss_above` (an
absolute bound, off unless set) or, from `warmup_min` losses on, above
`warmup_factor` times the highest loss seen so far. Early in training the
loss falls, so the highest loss seen is about the first one: a x10 spike
clears the x5 bound by far, and a clean loss never comes near it.

Why these defaults: the per-batch loss of small batches is heavy-tailed. On
the tiny example model (batches of 8x32 tokens), clean 2000-step runs over
four data seeds, with and without gradient clipping and with beta2 0.95 and
0.999, reach z 8.3 past the margin (one odd batch of one seed is 0.77 above
the level); the example's own batches (16x64 tokens) never pass the margin.
Spikes made by multiplying a loss of those runs at steps 50 to 1900 reach
at least z 17 (x3) and 80 (x10). A threshold of 12 sits between. With the
window's own spread instead (a 50-step median and MAD), clean runs reach
z 9.4 and a x10 spike at step 50 only 17.7, a x3 one 3.2.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from remedy.policies import AnomalyEvent
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats

_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its sigma


@dataclass
class LossSpikeDetector:
    """`loss_spike`: the loss exceeds the recent level by `z_threshold` noise sigmas and the margin."""

    window: int = 100  # losses whose successive differences give the noise scale
    level_window: int = 10  # latest losses whose median is the level
    min_history: int = 20
    noise_recent: int = 40  # latest losses whose differences also give a scale (see _noise)
    z_threshold: float = 12.0
    rel_tol: float = 0.25
    abs_tol: float = 0.0
    loss_above: float | None = None  # absolute bound, in force from the first step (None: off)
    warmup_min: int = 5  # losses needed before the warm-up bound applies
    warmup_factor: float = 5.0  # warm-up bound: this times the highest loss seen
    name: str = "loss_spike"
    _losses: deque[float] = field(default_factory=deque)
    _recent: deque[float] = field(init=False)  # the last `level_window` of them

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=self.level_window)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        loss = stats.loss
        if not math.isfinite(loss):
            return []
        out: list[AnomalyEvent] = []
        losses = self._losses
        spike = self._spike(loss)
        if spike is not None:
            z, threshold, level = spike
            # `history`: the losses it was judged against (fewer than min_history: warm-up bounds).
            out.append(
                event(
                    stats,
                    "loss_spike",
                    value=loss,
                    threshold=threshold,
                    zscore=round(z, 2),
                    median=level,
                    history=len(losses),
                )
            )
        if not out:
            losses.append(loss)
            self._recent.append(loss)
            if len(losses) > self.window:
                losses.popleft()
        return out

    def flags(self, loss: float, grad_norm: float, *, scaled: bool) -> bool:
        """Whether `observe` would call this loss a spike (the Guard asks before the update)."""
        del grad_norm, scaled
        return math.isfinite(loss) and self._spike(loss) is not None

    def _spike(self, loss: float) -> tuple[float, float, float] | None:
        """(z, threshold, level) when `loss` spikes above the window; None otherwise."""
        if len(self._losses) < self.min_history:
            return self._warmup_spike(loss)
        level = _median_sorted(sorted(self._recent))
        margin = max(self.rel_tol * abs(level), self.abs_tol)
        # Most steps fail the margin test; the noise scale (a sort) is needed only past it.
        if loss - level <= margin:
            return None
        sigma = self._noise()
        z = (loss - level) / sigma
        if z <= self.z_threshold:
            return None
        return z, level + max(self.z_threshold * sigma, margin), level

    def _warmup_spike(self, loss: float) -> tuple[float, float, float] | None:
        """Before `min_history`: a loss past `loss_above`, or past `warmup_factor` times the
        highest loss seen once there are `warmup_min` (z is then the ratio to that level)."""
        if self.loss_above is not None and loss > self.loss_above:
            level = max(self._losses, default=self.loss_above)
            return loss / max(abs(level), 1e-12), self.loss_above, level
        if len(self._losses) < max(self.warmup_min, 1):
            return None
        level = max(self._losses)
        bound = self.warmup_factor * abs(level)
        if loss <= bound:
            return None
        return loss / max(abs(level), 1e-12), bound, level

    @property
    def warming_up(self) -> bool:
        """Fewer than `min_history` losses: only the warm-up bounds judge."""
        return len(self._losses) < self.min_history

    def state_dict(self) -> dict[str, list[float]]:
        """The window of losses (the latest `level_window` of them are the level)."""
        return {"losses": list(self._losses)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        """The window back to `state` (a snapshot's)."""
        losses = [float(x) for x in state["losses"]][-self.window :]
        self._losses = deque(losses)
        self._recent = deque(losses[-self.level_window :], maxlen=self.level_window)

    def _noise(self) -> float:
        """The noise scale now: the larger of the window's and the latest `noise_recent` losses'.

        Step-to-step noise is not stationary: a classifier sits at ln(classes)
        with almost no noise for its first steps, then learns with a
        per-batch noise of 10-20% of the loss. Over the whole window the
        median difference is that of the quiet start until it has left the
        window, and ordinary batches read as z 15-35. The recent scale follows
        the noise as it grows; the window's keeps a quiet recent stretch from
        shrinking it.
        """
        sigma = _difference_sigma(self._losses)
        if 3 <= self.noise_recent < len(self._losses):
            recent = deque(
                itertools.islice(self._losses, len(self._losses) - self.noise_recent, None)
            )
            sigma = max(sigma, _difference_sigma(recent))
        return sigma

    def reset(self) -> None:
        self._losses.clear()
        self._recent.clear()


def _difference_sigma(xs: deque[float]) -> float:
    """Noise sigma of a series from the MAD of its successive differences (robust to a trend)."""
    it = iter(xs)
    prev = next(it)
    diffs = []
    for x in it:
        diffs.append(x - prev)
        prev = x
    diffs.sort()
    center = _median_sorted(diffs)
    spread = sorted(abs(d - center) for d in diffs)
    return max(_MAD_TO_SIGMA * _median_sorted(spread) / math.sqrt(2.0), 1e-12)


def _median_sorted(xs: list[float]) -> float:
    n = len(xs)
    mid = n // 2
    return xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2
