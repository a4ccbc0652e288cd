"""LR cuts that hold under any schedule: a multiplier applied around each optimizer step.

`shrink_lr` cannot simply scale `group["lr"]`: OneCycleLR, CyclicLR,
LambdaLR, a hand-written loop that sets `group["lr"]` each step, and every
scheduler on its closed-form path compute the next LR from scratch and
overwrite the cut at the next step. Scaling the schedulers' `base_lrs` as
well only helps those that read them.

So the cut is never written into the schedule. The param groups keep the
LR the schedule (or the user) computed, unscaled; `LRScale.applied` swaps
in `lr x scale` for the duration of the optimizer step and puts the
scheduled value back afterwards, so the scheduler's next step, a
`ReduceLROnPlateau` decision, a snapshot of the optimizer and the user's
own reads of `group["lr"]` all see the schedule as if no cut had happened,
and the optimizer applies exactly `factor x` what the uncut run would.
The scale is a remediation, not training state: a rollback keeps it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class LRScale:
    """The product of the LR cuts decided so far, and the floor they may not go below."""

    scale: float = 1.0
    floor: float = 0.0  # the highest `min_lr` of the cuts: a cut never takes an LR below it

    def cut(self, factor: float, *, min_lr: float = 0.0) -> None:
        self.scale *= factor
        self.floor = max(self.floor, min_lr)

    def effective(self, lr: float) -> float:
        """The LR the optimizer applies for a scheduled `lr` (never raised above `lr` itself)."""
        if self.scale == 1.0:
            return lr
        return max(lr * self.scale, min(lr, self.floor))

    def effective_lrs(self, optimizer: torch.optim.Optimizer) -> list[float]:
        return [self.effective(float(g["lr"])) for g in optimizer.param_groups]

    @contextlib.contextmanager
    def applied(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Within the block the param groups hold the cut LR; the scheduled one is put back after."""
        if self.scale == 1.0:
            yield
            return
        scheduled = [g["lr"] for g in optimizer.param_groups]
        try:
            for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
                cut = self.effective(float(lr))
                if isinstance(lr, torch.Tensor):  # a tensor LR (capturable optimizers) stays one
                    group["lr"] = torch.full_like(lr, cut)
                else:
                    group["lr"] = cut
            yield
        finally:
            for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
                group["lr"] = lr
