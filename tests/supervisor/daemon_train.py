"""A tiny data-parallel job for the supervisor-crash tests: an MLP that says what it applied.

Run supervised as `daemon_train.py:main -- --steps N --step-s S`: each step
sleeps `S` seconds, and from `--await-after` until a command has been
applied, `--await-s`: a supervisor that restarts (seconds, more on a loaded
machine) answers before the run ends.
It returns every command outcome its Guard applied and a digest of its
parameters, so a test can tell that a rollback was applied exactly once and
that the replicas stayed equal.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remedy.rank import Guard, GuardConfig, get_context


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument(
        "--await-after",
        type=int,
        default=None,
        help="from this step until the Guard has applied a command, steps take --await-s",
    )
    p.add_argument("--await-s", type=float, default=0.5)
    p.add_argument(
        "--await-count",
        type=int,
        default=1,
        help="how many commands the Guard must have applied for the --await-s steps to end",
    )
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    ctx = get_context()
    rank, world = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model: nn.Module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    if world > 1 and dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i * world + rank))
        return x, x @ target

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        return nn.functional.mse_loss(m(x), y)

    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.02),
        loss_fn=loss_fn,
        data=batch,
        max_steps=args.steps,
        config=GuardConfig(checkpoint_every=0),
    )
    last_step_at = time.time()
    for b in guard:  # the loop's end closes the Guard (its last reports wait for answers)
        result = guard.step(b)
        last_step_at = time.time()
        # A supervisor that is restarting answers seconds late: the run must last until it does.
        waiting = args.await_after is not None and result.step >= args.await_after
        awaiting = waiting and len(guard.history) < args.await_count
        time.sleep(args.await_s if awaiting else args.step_s)
    guard.close()
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().contiguous().numpy().tobytes())
    return {
        "applied": [
            {"decision_id": o.decision_id, "outcome": o.outcome, "step": o.step}
            for o in guard.history
        ],
        "params_digest": digest.hexdigest(),
        "last_step_at": last_step_at,
    }
