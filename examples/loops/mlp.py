"""An MLP classifier on generated tabular data: OneCycleLR, gradient clipping, a plain DataLoader.

    remedy run examples/loops/mlp.py:main -- --epochs 10
    python examples/loops/mlp.py --epochs 10 --run-dir runs/mlp   # alone; remedy report runs/mlp

The labels come from a fixed random "teacher" network with 5% of them
flipped, so the loss falls fast, then flattens at the noise floor: the shape
of most real classification runs, and the one a loss-spike detector tuned
on pretraining curves gets wrong.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from loops_common import make_loader, parse_args, report, total_steps, wrap_ddp
from torch import nn
from torch.utils.data import TensorDataset

from remedy import Guard, GuardConfig

FEATURES, CLASSES = 20, 5


def make_data(samples: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(samples, FEATURES, generator=gen)
    teacher = torch.randn(FEATURES, 32, generator=gen), torch.randn(32, CLASSES, generator=gen)
    y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(dim=1)
    flip = torch.rand(samples, generator=gen) < 0.05
    y[flip] = torch.randint(0, CLASSES, (int(flip.sum()),), generator=gen)
    return TensorDataset(x, y)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(__doc__.splitlines()[0], sys.argv[1:] if argv is None else argv)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    net = nn.Sequential(
        nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES)
    )
    # A zero head starts from uniform predictions: the loss sits at ln(CLASSES), almost
    # noiseless, for the first steps, then learns with the full noise of small batches.
    nn.init.zeros_(net[-1].weight)
    nn.init.zeros_(net[-1].bias)
    model = wrap_ddp(net)
    loader = make_loader(make_data(args.samples, args.seed), args.batch_size, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=args.lr,
        total_steps=total_steps(loader, args.epochs, args.max_steps),
        pct_start=0.05,  # a short warm-up: small classifiers learn fast
    )
    guard = Guard(
        model,
        optimizer,
        loss_fn=loss_fn,
        data=loader,  # a plain DataLoader: read `epochs` times, then the loop ends
        epochs=args.epochs,
        max_steps=args.max_steps,
        scheduler=scheduler,
        config=GuardConfig(grad_clip=1.0, policy=args.policy),
        run_dir=args.run_dir,
    )
    for batch in guard:
        guard.step(batch)
    summary = guard.close()
    x, y = loader.dataset.tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        accuracy = float((model(x).argmax(dim=1) == y).float().mean())
    return report("mlp", summary, args.quiet, final_loss=summary["final_loss"], accuracy=accuracy)


if __name__ == "__main__":
    main()
