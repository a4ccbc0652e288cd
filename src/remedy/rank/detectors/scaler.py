"""AMP GradScaler trouble: overflow storms and a collapsed loss scale.

A GradScaler skips a step and halves its scale whenever the scaled
gradients overflow; an occasional skip is how it finds its scale, and a
fresh scaler skips a few times at the start. A storm is different: many
skips in a short window mean the run is losing steps, usually because the
scale is far too high (it keeps growing back into overflow) or because the
gradients really are huge.

A collapse is the end of a long storm: after enough halvings the scale
falls below 1, the gradients are scaled *down* before the fp16 backward, and
small gradients underflow to zero. The floor defaults to 1.0, the minimum
loss scale that DeepSpeed and Megatron-LM use by default.

Both read `StepStats.loss_scale` and `scaler_skipped`, which the Guard fills
when it owns an enabled scaler, and stay silent otherwise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from remedy.policies import AnomalyEvent
from remedy.rank.detectors._robust import Cooldown
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats


@dataclass
class ScalerOverflowDetector:
    """`scaler_overflow`: more than `max_rate` of the last `window` steps were skipped.

    The rate is over the full window (a window not yet full counts its
    missing steps as clean), so the few skips of a fresh scaler finding its
    scale never fire; `min_skips` guards short windows.
    """

    window: int = 100
    max_rate: float = 0.25
    min_skips: int = 5
    cooldown_steps: int = 100
    name: str = "scaler_overflow"
    _skips: deque[bool] = field(default_factory=deque)
    _count: int = 0
    _cooldown: Cooldown = field(init=False)

    def __post_init__(self) -> None:
        self._cooldown = Cooldown(self.cooldown_steps)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        if stats.loss_scale is None:
            return []
        skipped = bool(stats.scaler_skipped)
        self._skips.append(skipped)
        self._count += skipped
        if len(self._skips) > self.window:
            self._count -= self._skips.popleft()
        rate = self._count / self.window
        if not skipped or self._count < self.min_skips or rate <= self.max_rate:
            return []
        if not self._cooldown.ready(stats.tick):
            return []
        self._cooldown.fire(stats.tick)
        return [
            event(
                stats,
                "scaler_overflow",
                value=rate,
                threshold=self.max_rate,
                skipped=self._count,
                window=self.window,
                loss_scale=stats.loss_scale,
            )
        ]

    @property
    def warming_up(self) -> bool:
        """Never: a window not yet full counts its missing steps as clean."""
        return False

    def state_dict(self) -> dict[str, list[bool]]:
        """The window of skipped steps: the timeline's, as the scale a snapshot restores."""
        return {"skips": list(self._skips)}

    def load_state_dict(self, state: dict[str, list[bool]]) -> None:
        """The window back to `state` (a snapshot's)."""
        self._skips = deque(bool(x) for x in list(state["skips"])[-self.window :])
        self._count = sum(self._skips)

    def reset(self) -> None:
        self._skips.clear()
        self._count = 0


@dataclass
class ScalerCollapseDetector:
    """`scaler_collapse`: the loss scale fell below `floor`.

    Fires when the scale crosses the floor, then again every `cooldown_steps`
    while it stays below; critical, since updates are being lost to underflow.
    Each collapse is its own incident: a scale that recovers (a rescue) and
    collapses again (the storm outlasted the rescue) fires at once, and a
    scale still below the floor `cooldown_steps` after the last event (a
    rescue that failed, or none came) fires again. A policy's own cooldown on
    this anomaly would count from the first rescue instead, so the bundled
    rules keep theirs short and bound the rescues with `max_fires`.
    """

    floor: float = 1.0
    # 20, not 200: a rescue that failed is answered within 20 steps, not after the
    # run has trained 200 steps on gradients that underflow to zero.
    cooldown_steps: int = 20
    name: str = "scaler_collapse"
    _below: bool = False
    _cooldown: Cooldown = field(init=False)

    def __post_init__(self) -> None:
        self._cooldown = Cooldown(self.cooldown_steps)

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        scale = stats.loss_scale
        if scale is None:
            return []
        if scale >= self.floor:
            if self._below:
                self._below = False
                self._cooldown.clear()  # a new collapse after a recovery is news at once
            return []
        self._below = True
        if not self._cooldown.ready(stats.tick):
            return []
        self._cooldown.fire(stats.tick)
        return [
            event(stats, "scaler_collapse", value=scale, threshold=self.floor, severity="critical")
        ]

    def reset(self) -> None:
        self._below = False
