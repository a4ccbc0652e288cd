"""A user's loop from the README's DDP section, with `fully_shard` on each block and the root.

Run by `remedy run tests/workers/fsdp_train.py:main --workers N`; returns the
whole parameters' digest (gathered at the end, every rank the same).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from remedy import Guard, GuardConfig, get_context


def main(argv: list[str]) -> dict[str, Any]:
    ctx = get_context()
    rank, world = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    if world > 1 and dist.is_initialized():
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i * world + rank))
        return x, torch.tanh(x @ target)

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0]), b[1])

    steps = int(argv[0]) if argv else 30
    guard = Guard(model, optimizer, loss_fn=loss_fn, data=batch, max_steps=steps,
                  config=GuardConfig(grad_clip=1.0))  # fmt: skip
    for b in guard:
        guard.step(b)
    digest = hashlib.sha256()
    for p in model.parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        digest.update(whole.detach().contiguous().numpy().tobytes())
    guard.close()
    return {"params_digest": digest.hexdigest()}
