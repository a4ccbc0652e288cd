"""Non-finite values and gradient-norm bounds.

These need no history: the loss and the global gradient norm arrive on the
host once per step (one fused sync), and a non-finite loss or norm is an
anomaly at once. The Guard skips the optimizer step itself before asking the
policy anything, so nothing non-finite is ever applied to the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from remedy.policies import AnomalyEvent
from remedy.workers.detectors.base import event
from remedy.workers.stats import StepStats


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
    """`grad_norm_explosion` above `explode_above`, `grad_norm_vanishing` below `vanish_below`.

    Vanishing must persist for `vanish_patience` consecutive steps: a single
    tiny norm happens legitimately (e.g. a batch of padding).
    """

    explode_above: float = 1e4
    vanish_below: float = 1e-6
    vanish_patience: int = 3
    name: str = "grad_norm"
    _low_streak: int = 0

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        norm = stats.grad_norm
        if not math.isfinite(norm) or stats.scaler_skipped:
            return []
        if norm > self.explode_above:
            self._low_streak = 0
            return [
                event(
                    stats,
                    "grad_norm_explosion",
                    value=norm,
                    threshold=self.explode_above,
                    severity="warning",
                )
            ]
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

    def flags(self, loss: float, grad_norm: float, *, scaled: bool) -> bool:
        """Whether `observe` will report an explosion for this norm (vanishing needs a streak)."""
        del loss, scaled
        return math.isfinite(grad_norm) and grad_norm > self.explode_above

    def reset(self) -> None:
        self._low_streak = 0
