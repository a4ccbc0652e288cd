"""Regression in bf16 autocast with a CPU GradScaler: warm restarts of a cosine LR, a DataLoader.

    remedy run examples/loops/amp_mlp.py:main -- --epochs 10
    python examples/loops/amp_mlp.py --run-dir runs/amp_mlp

The Guard runs the forward under `torch.autocast("cpu", dtype=torch.bfloat16)`
(`GuardConfig(amp_dtype=...)`) and scales the loss with the GradScaler it
is given; on a GPU the same loop takes `GradScaler("cuda")`. bf16 has the
range of fp32, so the scale grows and overflows stay rare: the scaler
detectors must stay quiet.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from loops_common import make_loader, parse_args, report, wrap_ddp
from torch import nn
from torch.utils.data import TensorDataset

from remedy import Guard, GuardConfig

FEATURES = 16


def make_data(samples: int, seed: int) -> TensorDataset:
    """y = a smooth nonlinear function of x, plus noise."""
    gen = torch.Generator().manual_seed(4000 + seed)
    x = torch.randn(samples, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 4, generator=gen)
    y = torch.sin(x @ w).sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=gen)
    return TensorDataset(x, y)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(__doc__.splitlines()[0], sys.argv[1:] if argv is None else argv)
    torch.manual_seed(args.seed)
    model = wrap_ddp(
        nn.Sequential(
            nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
        )
    )
    loader = make_loader(make_data(args.samples, args.seed), args.batch_size, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=200, T_mult=2)
    scaler = torch.amp.GradScaler("cpu")
    guard = Guard(
        model,
        optimizer,
        loss_fn=loss_fn,
        data=loader,
        epochs=args.epochs,
        max_steps=args.max_steps,
        scheduler=scheduler,
        scaler=scaler,
        config=GuardConfig(amp_dtype=torch.bfloat16, policy=args.policy),
        run_dir=args.run_dir,
    )
    for batch in guard:
        guard.step(batch)
    summary = guard.close()
    return report(
        "amp_mlp",
        summary,
        args.quiet,
        final_loss=summary["final_loss"],
        loss_scale=scaler.get_scale(),
    )


if __name__ == "__main__":
    main()
