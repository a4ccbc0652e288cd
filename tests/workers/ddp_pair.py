"""The small DDP job that the real-gloo detector tests run on two ranks: the model and each rank's batches.

The ranks themselves are spawned by `tests.workers.fsdp_ranks.spawn_ranks`
(a gloo group per call, each rank's return value handed back); a test's rank
function builds its model and data here and adds only its own fault.
"""

from __future__ import annotations

import torch
from torch import nn


def ddp_mlp() -> nn.Module:
    """A 16-32-1 MLP under DDP, the same initial weights on every rank (seed 0)."""
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    )


def rank_batches(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """`count` batches of 8 rows for `rank` (its own seed), each with its index for a fault to key on."""
    gen = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen), i)
        for i in range(count)
    ]
