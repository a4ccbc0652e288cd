"""Updates that no longer move the weights: the optimizer runs but training has stopped.

The causes are mundane and silent: a learning rate driven to zero, every
step skipped, updates rounded away in low precision, parameters frozen by
mistake. The loss alone does not tell a stall from a plateau; the weights do.

Watching every weight would cost a full copy per step, so the detector keeps
a fixed random sample of `sample_size` trainable elements (indices drawn
once, spread over the parameters in proportion to their size) and reads it
every `every` steps: a handful of small gathers, then a copy to the host.
On CUDA the copy goes into pinned memory without blocking and is compared
one period later, when it has long finished, so the detector adds no host
synchronisation at all. The relative change of the sample between two reads,
`‖θ_t − θ_{t−every}‖ / ‖θ_{t−every}‖`, below `min_rel_change` for `patience`
reads in a row is a stall.

Pass the model to the constructor or to `attach(model)` (a Guard attaches
its own model to a detector built without one); until then the detector
stays silent.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from remedy.policies import AnomalyEvent
from remedy.rank.detectors._robust import Cooldown
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats
from remedy.rank.state.sharding import local


@dataclass
class UpdateStallDetector:
    """`update_stall`: a sample of the weights stops changing for `patience` reads."""

    model: torch.nn.Module | None = field(default=None, repr=False)
    sample_size: int = 1024  # weight elements watched
    every: int = 10  # steps between reads of the sample
    min_rel_change: float = 1e-6  # relative change per read below this is "no change"
    patience: int = 5  # stalled reads in a row (50 steps by default)
    cooldown_steps: int = 500
    seed: int = 0
    name: str = "update_stall"
    _picks: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _pending: deque[tuple[torch.Tensor, Any, int]] = field(default_factory=deque)
    _previous: torch.Tensor | None = None
    _streak: int = 0
    _skipped: int = 0
    _cooldown: Cooldown = field(init=False)

    def __post_init__(self) -> None:
        self._cooldown = Cooldown(self.cooldown_steps)
        if self.model is not None:
            self.attach(self.model)

    def attach(self, model: torch.nn.Module) -> None:
        """Choose the watched elements of `model`'s trainable parameters (once)."""
        self.model = model
        # A sharded model's parameters are DTensors: each rank watches elements of its own shard.
        params = [local(p) for p in model.parameters() if p.requires_grad and local(p).numel() > 0]
        self._picks = []
        self.reset()
        if not params:
            return
        sizes = torch.tensor([p.numel() for p in params], dtype=torch.float64)
        gen = torch.Generator().manual_seed(self.seed)
        owner = torch.multinomial(sizes, self.sample_size, replacement=True, generator=gen)
        for i, p in enumerate(params):
            count = int((owner == i).sum())
            if count:
                idx = torch.randint(0, p.numel(), (count,), generator=gen)
                self._picks.append((p, idx.to(p.device)))

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        if not self._picks:
            return []
        self._skipped += int(stats.optimizer_skipped)
        if stats.step % self.every:
            return []
        self._read(stats.tick)
        return self._compare(stats)

    def _read(self, tick: int) -> None:
        with torch.no_grad():
            # One `take` per watched tensor: the fewest dispatches that gather the sample.
            parts = [torch.take(p, idx) for p, idx in self._picks]
            sample = torch.cat(parts).float()
        if sample.device.type == "cuda":
            host = torch.empty(sample.shape, dtype=sample.dtype, pin_memory=True)
            host.copy_(sample, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._pending.append((host, done, tick))
        else:
            self._pending.append((sample, None, tick))

    def _compare(self, stats: StepStats) -> list[AnomalyEvent]:
        out: list[AnomalyEvent] = []
        while self._pending:
            host, done, _ = self._pending[0]
            if done is not None and not done.query():
                break  # still copying: compare at the next read
            self._pending.popleft()
            if self._previous is not None:
                change = float(
                    (host - self._previous).norm() / self._previous.norm().clamp_min(1e-30)
                )
                out.extend(self._verdict(stats, change))
            self._previous = host
        return out

    def _verdict(self, stats: StepStats, change: float) -> list[AnomalyEvent]:
        if change >= self.min_rel_change:
            self._streak, self._skipped = 0, 0
            return []
        self._streak += 1
        if self._streak < self.patience or not self._cooldown.ready(stats.tick):
            return []
        self._cooldown.fire(stats.tick)
        return [
            event(
                stats,
                "update_stall",
                value=change,
                threshold=self.min_rel_change,
                steps=self._streak * self.every,
                skipped_steps=self._skipped,
                lr=stats.lr,
            )
        ]

    def reset(self) -> None:
        """After a rollback the weights jumped back: start comparing afresh."""
        self._pending.clear()
        self._previous = None
        self._streak = 0
        self._skipped = 0
