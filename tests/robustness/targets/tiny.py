"""A tiny supervised job: a linear model trained a few steps under the Guard.

`main(argv)`: `--steps N` (default 20), `--sleep S` seconds per step (default 0),
`--raise-at N` raises a RuntimeError at step N, `--unpicklable` returns a
value that cannot be pickled, `--checkpoint-every N` writes durable checkpoints
(default 0: none), `--say-every N` prints a line every N steps.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import torch
from torch import nn

from remedy import Guard
from remedy.rank import GuardConfig


def main(argv: list[str]) -> dict[str, Any]:
    """Train for `--steps` steps; fail or misbehave as the flags ask."""
    p = argparse.ArgumentParser(prog="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--raise-at", type=int, default=-1)
    p.add_argument("--unpicklable", action="store_true")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--say-every", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        return x, x @ w

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0]), b[1])

    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        loss_fn=loss_fn,
        data=batch,
        max_steps=args.steps,
        config=GuardConfig(checkpoint_every=args.checkpoint_every),
    )
    for step, b in enumerate(guard):
        if step == args.raise_at:
            explode(step)
        guard.step(b)
        if args.say_every and step % args.say_every == 0:
            print(f"tiny: step {step}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    out: dict[str, Any] = {"summary": guard.close()}
    if args.unpicklable:
        out["lock"] = threading.Lock()
    return out


def explode(step: int) -> None:
    """The user's own bug, raised from the user's own frame."""
    raise RuntimeError(f"loss went sideways at step {step}")
