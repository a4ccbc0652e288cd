"""What the example loops share: their command line, DDP wrapping and data sharding.

Each loop in this folder is an ordinary PyTorch training script; these are
the few helpers a user would write once. With `remedy run --workers N` every
rank calls the loop's `main`; `get_context()` tells it its rank and the world
size (None when run alone, in one process).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from remedy import get_context


def parse_args(description: str, argv: list[str], **defaults: Any) -> argparse.Namespace:
    """The flags every loop takes; `defaults` sets the loop's own defaults."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=None, help="stop earlier than the epochs")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=4096, help="size of the generated data set")
    p.add_argument("--policy", default=None, help="alone: policy file or bundled name")
    p.add_argument("--run-dir", default=None, help="alone: where to write the run directory")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(**defaults)
    return p.parse_args(argv)


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) under `remedy run`; (0, 1) when the script runs alone."""
    ctx = get_context()
    return (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)


def wrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """DDP when remedy started several ranks (it initialises the process group), else as is."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return torch.nn.parallel.DistributedDataParallel(model)
    return model


def make_loader(dataset: Dataset[Any], batch_size: int, seed: int) -> DataLoader[Any]:
    """A plain shuffling DataLoader; with several ranks each reads its own shard.

    The Guard calls `set_epoch` on the DistributedSampler before every epoch,
    so each epoch is shuffled anew and identically on every rank.
    """
    rank, world = rank_and_world()
    if world > 1:
        sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed
        )
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=gen, drop_last=True)


def total_steps(loader: DataLoader[Any], epochs: int, max_steps: int | None) -> int:
    """Steps the run will take: for schedulers that need the length up front (OneCycleLR)."""
    steps = len(loader) * epochs
    return min(steps, max_steps) if max_steps is not None else steps


def report(name: str, summary: dict[str, Any], quiet: bool, **extra: Any) -> dict[str, Any]:
    """Print one line when run alone; return what `remedy run` shows as the rank's result."""
    if get_context() is None and not quiet:
        parts = " ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items()
        )
        print(f"{name}: {summary['status']}, {summary['steps_completed']} steps, {parts}")
    return {**extra, "status": summary["status"], "steps": summary["steps_completed"]}
