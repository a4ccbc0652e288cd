"""A tiny job for the display, report and explain tests: a small MLP that prints as users do.

Run supervised as a file target (`display_train.py:main -- --steps N`) or
standalone (`python display_train.py --run-dir DIR`). It prints a line of
its own every 10 steps on stdout and one on stderr at the start, raises
at `--crash-at` to make a crashed run, and makes one NaN loss at `--nan-at`
(chaos faults need a supervisor; this works standalone too).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn

from remedy.rank import Guard, GuardConfig


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument(
        "--nan-at", type=int, default=None, help="a NaN loss the first time this step runs"
    )
    p.add_argument("--run-dir", default=None, help="standalone only")
    p.add_argument("--policy", default=None, help="standalone only")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        return x, x @ target

    poisoned: list[int] = []

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        loss = nn.functional.mse_loss(m(x), y)
        if guard.step_count == args.nan_at and not poisoned:
            poisoned.append(guard.step_count)  # chaos faults need a supervisor; this works alone
            loss = loss * float("nan")
        return loss

    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.02),
        loss_fn=loss_fn,
        data=batch,
        max_steps=args.steps,
        config=GuardConfig(checkpoint_every=0, policy=args.policy, detectors=None),
        run_dir=args.run_dir,
    )
    print("user: training starts", file=sys.stderr, flush=True)
    for b in guard:
        result = guard.step(b)
        if result.step % 10 == 0:
            print(f"user: step {result.step} loss {result.loss:.4f}", flush=True)
        if args.crash_at is not None and result.step == args.crash_at:
            raise RuntimeError(f"user code failed at step {result.step}")
    return {"summary": guard.close()}


if __name__ == "__main__":
    main()
