"""Non-finite values and gradient-norm bounds.

The loss and the global gradient norm arrive on the host once per step (one
fused sync): a non-finite loss or norm is an anomaly at once, and the norm
is judged against its own recent median. The Guard skips the optimizer step itself before asking the
policy anything, so nothing non-finite is ever applied to the weights.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from remedy.policies import AnomalyEvent
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats


@dataclass
class NonFiniteDetector:
    """`nonfinite_loss` when the loss is NaN/inf, else `nonfinite_grad` when the norm is."""

    name: str = "nonfinite"

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        if not math.isfinite(stats.loss):
            return [
                event(
                    stats, "nonfinite_loss", value=stats.loss, threshold=None, severity="critical"
                )
            ]
        if not math.isfinite(stats.grad_norm) and not stats.scaler_skipped:
            # With a GradScaler, inf gradients are its normal overflow signal
            # (the scaler detector counts those); without one they are an anomaly.
            culprit = stats.extra.get("nonfinite_param")
            details = {"param": culprit, "module": module_of(culprit)} if culprit else {}
            return [
                event(
                    stats,
                    "nonfinite_grad",
                    value=stats.grad_norm,
                    threshold=None,
                    severity="critical",
                    **details,
                )
            ]
        return []

    def flags(self, loss: float, grad_norm: float, *, scaled: bool) -> bool:
        """Whether `observe` will report this step: a non-finite loss, or norm without a scaler.

        With an enabled GradScaler (`scaled`), inf gradients are its overflow signal.
        """
        return not math.isfinite(loss) or (not math.isfinite(grad_norm) and not scaled)

    def reset(self) -> None:
        """Stateless."""


def module_of(param_name: str) -> str:
    """The qualified module name that owns a parameter (`blocks.0.attn.qkv.weight` -> `blocks.0.attn.qkv`)."""
    module, _, _ = param_name.rpartition(".")
    return module or "<root>"


@dataclass
class GradNormDetector:
    """`grad_norm_explosion` far above the norm's running baseline (or above an absolute bound),
    `grad_norm_vanishing` below `vanish_below`.

    The baseline is the median of the last `window` finite norms, once there
    are `min_steps` of them: a norm over `explode_ratio` times it is an
    explosion. The scale of a gradient norm depends on the model, its size
    and its loss, so a fixed bound alone (`explode_above`) misses an LR too
    large for the model: a norm climbing from 1.5 to 136 over 20 steps, the
    loss from 1.9 to 900 (an HF GPT-2 at LR 10). A median is not moved by
    the spike it judges, and it follows a norm that falls as training
    converges. Vanishing must persist for `vanish_patience` consecutive
    steps: a single tiny norm happens legitimately (e.g. a batch of padding).

    The window is the timeline's history (`detectors.history`): a snapshot
    carries it, a rollback or an adoption restores it. A step whose update
    was skipped (non-finite, a scaler overflow, a dropped batch) is judged
    but never joins the window: the norms of updates not applied (a frozen
    model meeting the skipped batches after a rollback) would drag the
    median down, and the ordinary norms after them would read as explosions.
    Until `min_steps` norms it says it is warming up, and only
    `explode_above` judges.
    """

    explode_above: float = 1e4
    explode_ratio: float = 10.0
    window: int = 100
    min_steps: int = 20
    vanish_below: float = 1e-6
    vanish_patience: int = 3
    name: str = "grad_norm"
    _low_streak: int = 0
    _recent: deque[float] = field(default_factory=deque)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        norm = stats.grad_norm
        if not math.isfinite(norm) or stats.scaler_skipped:
            return []
        explosion = self._explosion(norm)
        if explosion is not None:
            self._low_streak = 0
            threshold, baseline = explosion
            details = {"baseline": baseline, "ratio": round(norm / baseline, 2)} if baseline else {}
            # Clipped to a bound below the norm, the update already was bounded: `info`, which
            # the default policy notifies of instead of cutting the LR for the rest of the run.
            clip = stats.grad_clip
            clipped = clip is not None and norm > clip
            if clip is not None and clipped:
                details["clipped_to"] = clip
            return [
                event(
                    stats,
                    "grad_norm_explosion",
                    value=norm,
                    threshold=threshold,
                    severity="info" if clipped else "warning",
                    **details,
                )
            ]
        if stats.optimizer_skipped:
            return []  # not an update: it joins no baseline and no vanishing streak
        self._remember(norm)
        if norm < self.vanish_below:
            self._low_streak += 1
            if self._low_streak >= self.vanish_patience:
                return [
                    event(
                        stats,
                        "grad_norm_vanishing",
                        value=norm,
                        threshold=self.vanish_below,
                        streak=self._low_streak,
                    )
                ]
            return []
        self._low_streak = 0
        return []

    def _explosion(self, norm: float) -> tuple[float, float | None] | None:
        """(threshold crossed, baseline or None) if `norm` is an explosion, else None."""
        if len(self._recent) >= self.min_steps:
            baseline = statistics.median(self._recent)
            if baseline > 0 and norm > self.explode_ratio * baseline:
                return self.explode_ratio * baseline, baseline
        if norm > self.explode_above:
            return self.explode_above, None
        return None

    def _remember(self, norm: float) -> None:
        """An ordinary norm joins the baseline (an exploded one does not, so it stays put)."""
        self._recent.append(norm)
        if len(self._recent) > self.window:
            self._recent.popleft()

    def flags(self, loss: float, grad_norm: float, *, scaled: bool) -> bool:
        """Whether `observe` will report an explosion for this norm (vanishing needs a streak)."""
        del loss, scaled
        return math.isfinite(grad_norm) and self._explosion(grad_norm) is not None

    @property
    def warming_up(self) -> bool:
        """Fewer than `min_steps` norms: only `explode_above` judges."""
        return len(self._recent) < self.min_steps

    def state_dict(self) -> dict[str, Any]:
        """The window of norms and the vanishing streak."""
        return {"norms": list(self._recent), "low_streak": self._low_streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The window back to `state` (a snapshot's)."""
        self._recent = deque(float(x) for x in list(state["norms"])[-self.window :])
        self._low_streak = int(state.get("low_streak", 0))

    def reset(self) -> None:
        """A new run: the baseline is learned from the first steps."""
        self._low_streak = 0
        self._recent.clear()
