"""A 2-rank DDP loop whose rank 0 alone evaluates or saves between steps, as nanoGPT's does.

    remedy run tests/supervisor/phases_train.py:main --workers 2 -- --steps 300 --eval-every 50
    torchrun --nproc_per_node 2 tests/supervisor/phases_train.py --run-dir runs/p --steps 300

Rank 0 evaluates for `--eval-s` seconds (real forward passes over held-out
batches until the time is up) every `--eval-every` steps, and saves a
checkpoint (`torch.save` of the model and optimizer, written again until it
has taken `--save-factor` times the mean step time so far) every
`--save-every` steps; the other rank goes straight on into the next step
and waits for rank 0 in its all-reduce. `--declare` wraps both in
`guard.phase(...)`; without it they are the measured phase between steps.
`--eval-after` evaluates after the step instead of before it: rank 0 is then
a step behind rank 1 while it evaluates (rank 1 waits in the next step),
which the hang watch sees in the ranks' pings. `--eval-ranks all` has every
rank evaluate (as HF's Trainer does); `--die-in-eval R` makes rank R's process
kill itself halfway through its first eval (a crash in the loop's own code, while
its peers evaluate), once: `--die-marker` names a file it creates first, and a
process that finds it there does not die. `--eval-on-resume` evaluates only
at the step a restarted process resumes from (a loop whose eval falls on its
checkpoint steps), with `--checkpoint-every` setting those.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remedy import Guard, GuardConfig, get_context

FEATURES = 32


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-s", type=float, default=3.0)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--save-factor", type=float, default=10.0)
    p.add_argument("--eval-after", action="store_true", help="evaluate after the step")
    p.add_argument("--declare", action="store_true", help="wrap eval and save in guard.phase")
    p.add_argument("--eval-ranks", choices=("0", "all"), default="0")
    p.add_argument("--die-in-eval", type=int, default=-1, help="rank that dies in its eval")
    p.add_argument("--die-marker", default=None, help="created by the rank that dies")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--eval-on-resume", action="store_true",
                   help="evaluate only at the step a restarted process resumes from")  # fmt: skip
    p.add_argument("--run-dir", default=None, help="without a supervisor")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def batch_of(index: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    x = torch.randn(32, FEATURES, generator=gen)
    return x, x[:, :1].tanh() + 0.05 * torch.randn(32, 1, generator=gen)


@torch.no_grad()
def evaluate(model: nn.Module, seconds: float, seed: int, die_at: float | None = None) -> float:
    """Held-out loss over as many batches as `seconds` allows (at least one); with `die_at`,
    the process kills itself that many seconds in."""
    model.eval()
    losses: list[float] = []
    start = time.perf_counter()
    end = start + seconds
    while not losses or time.perf_counter() < end:
        if die_at is not None and time.perf_counter() - start >= die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        losses.append(float(loss_fn(model, batch_of(10_000_000 + len(losses), seed))))
    model.train()
    return sum(losses) / len(losses)


def save(model: nn.Module, optimizer: torch.optim.Optimizer, seconds: float) -> int:
    """A checkpoint written again until `seconds` have passed; its size in bytes."""
    end = time.perf_counter() + seconds
    size = 0
    while size == 0 or time.perf_counter() < end:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
        size = buf.tell()
    return size


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ctx = get_context()
    rank, world = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    torch.manual_seed(args.seed)
    raw = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 1))
    model: nn.Module = raw
    if world > 1 and dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(raw)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(
        model,
        optimizer,
        loss_fn=loss_fn,
        data=lambda i: batch_of(i * world + rank, args.seed),
        max_steps=args.steps,
        run_dir=args.run_dir,
        config=GuardConfig(snapshot_every=10, checkpoint_every=args.checkpoint_every),
    )
    step_s: list[float] = []
    evals = saves = 0

    resumed = ctx.resume_step if ctx is not None else None

    def maybe_evaluate(step: int) -> int:
        evaluates = rank == 0 or args.eval_ranks == "all"
        if args.eval_on_resume:
            evaluates = evaluates and step == resumed
        if evaluates and args.eval_every and step % args.eval_every == 0 and step > 0:
            die_at = None
            if rank == args.die_in_eval and args.die_marker and not Path(args.die_marker).exists():
                Path(args.die_marker).touch()
                die_at = args.eval_s / 2
            with guard.phase("eval") if args.declare else contextlib.nullcontext():
                evaluate(raw, args.eval_s, args.seed, die_at)
            return 1
        return 0

    for batch in guard:
        step = guard.next_step
        if not args.eval_after:
            evals += maybe_evaluate(step)
        if rank == 0 and args.save_every and step % args.save_every == 0 and step > 0:
            mean = sum(step_s[-50:]) / max(len(step_s[-50:]), 1)
            with guard.phase("save") if args.declare else contextlib.nullcontext():
                save(raw, optimizer, args.save_factor * mean)
            saves += 1
        t0 = time.perf_counter()
        guard.step(batch)
        step_s.append(time.perf_counter() - t0)
        if args.eval_after:
            evals += maybe_evaluate(step)
    summary = guard.close()
    return {"status": summary["status"], "evals": evals, "saves": saves}


def init_group() -> None:
    """Under torchrun: form the gloo group from the environment torchrun sets."""
    dist.init_process_group("gloo")


if __name__ == "__main__":
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_group()
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
