"""A tiny DDP job for the durable-checkpoint and full-group-restart tests.

Run by the supervisor as a file target (`durable_train.py:main -- ARGS`).
Its snapshot and checkpoint cadence come from the arguments, so a test can
make a rollback reach past the snapshot ring to the disk. With
`--fail-replacement gen1` a replacement rank (incarnation 2 or more) of
generation 1 raises before training, as a node that keeps failing would:
targeted restarts fail and the full-group restart (generation 2) succeeds;
with `always` every replacement raises, the full restart too. With
`--loader` the same batches come from a plain `DataLoader`, which a new
process cannot read at its position: it reads up to it.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remedy.rank import Guard, GuardConfig, get_context


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--snapshot-every", type=int, default=5)
    p.add_argument("--snapshot-ring", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--checkpoint-keep", type=int, default=3)
    # Steps of a few ms would end the run before a command's round trip (heartbeats every 0.5 s).
    p.add_argument("--step-sleep", type=float, default=0.03)
    p.add_argument("--fail-replacement", choices=["none", "gen1", "always"], default="none")
    # The same batches from a plain DataLoader, which cannot be read at an index.
    p.add_argument("--loader", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str]) -> dict[str, Any]:
    """Train a small MLP with Adam on a per-rank shard of a seeded stream; return its digest."""
    args = parse_args(argv)
    ctx = get_context()
    rank, world = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    incarnation = getattr(ctx.reporter, "incarnation", 1) if ctx else 1
    generation = ctx.membership.generation if ctx and ctx.membership is not None else 0
    failing = incarnation >= 2 and (
        args.fail_replacement == "always" or (args.fail_replacement == "gen1" and generation == 1)
    )
    if failing:
        raise RuntimeError(f"replacement of rank {rank} in generation {generation} keeps failing")
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    if world > 1 and dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i * world + rank))
        return x, torch.tanh(x @ target)

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        time.sleep(args.step_sleep)
        x, y = b
        return nn.functional.mse_loss(m(x), y)

    data: Any = batch
    if args.loader:
        shard = [batch(i) for i in range(args.steps)]
        xs, ys = torch.cat([x for x, _ in shard]), torch.cat([y for _, y in shard])
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=16)
    guard = Guard(
        model,
        optimizer,
        loss_fn=loss_fn,
        data=data,
        max_steps=args.steps,
        config=GuardConfig(
            snapshot_every=args.snapshot_every,
            snapshot_ring=args.snapshot_ring,
            checkpoint_every=args.checkpoint_every,
            checkpoint_keep=args.checkpoint_keep,
        ),
    )
    for b in guard:
        guard.step(b)
    guard.close()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return {"params_digest": digest.hexdigest()}
