"""A tiny DDP job for the straggler test: rank 1's loss function sleeps every step.

Run by the supervisor as a file target (`straggler_train.py:main`). The Guard
times the DDP model's all-reduces itself (its `CollectiveSlowDetector` has no
timer of its own): the other ranks wait for rank 1 in the all-reduce, so only
the time outside collectives tells who is slow.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remedy.rank import Guard, GuardConfig, get_context
from remedy.rank.detectors import CollectiveSlowDetector

STEPS = 40
SLOW_RANK = 1
SLEEP_S = 0.15


def main(argv: list[str]) -> dict[str, Any]:
    """Train a linear model for `STEPS` steps; rank `SLOW_RANK` is late for every all-reduce."""
    del argv
    ctx = get_context()
    rank = ctx.rank if ctx else 0
    torch.manual_seed(0)
    model: nn.Module = nn.Linear(8, 1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        model = nn.parallel.DistributedDataParallel(model)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * rank + i))
        return x, x @ target

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if rank == SLOW_RANK:
            time.sleep(SLEEP_S)  # a slow host: the others wait for it in the all-reduce
        x, y = b
        return nn.functional.mse_loss(m(x), y)

    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        loss_fn=loss_fn,
        data=batch,
        max_steps=STEPS,
        config=GuardConfig(detectors=[CollectiveSlowDetector()], checkpoint_every=0),
    )
    for b in guard:
        guard.step(b)
    return {"summary": guard.close()}
