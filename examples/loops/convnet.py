"""A small conv net on generated images: LambdaLR warm-up and decay, a plain DataLoader.

    remedy run examples/loops/convnet.py:main -- --epochs 16
    python examples/loops/convnet.py --run-dir runs/convnet

Each 1x16x16 image holds one of four noisy shapes (a horizontal bar, a
vertical bar, a cross, a box) at a random place: learnable in a few hundred
steps by two conv layers, and small enough for a CPU.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from loops_common import make_loader, parse_args, report, total_steps, wrap_ddp
from torch import nn
from torch.utils.data import TensorDataset

from remedy import Guard, GuardConfig

SIZE, CLASSES = 16, 4


def make_data(samples: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(2000 + seed)
    y = torch.randint(0, CLASSES, (samples,), generator=gen)
    x = 0.5 * torch.randn(samples, 1, SIZE, SIZE, generator=gen)
    at = torch.randint(3, SIZE - 3, (samples, 2), generator=gen)
    for i in range(samples):
        r, c = int(at[i, 0]), int(at[i, 1])
        label = int(y[i])
        if label in (0, 2):  # horizontal bar (also half of the cross)
            x[i, 0, r, c - 3 : c + 4] += 1.5
        if label in (1, 2):  # vertical bar
            x[i, 0, r - 3 : r + 4, c] += 1.5
        if label == 3:  # box outline
            x[i, 0, r - 2 : r + 3, c - 2 : c + 3] += 1.5
            x[i, 0, r - 1 : r + 2, c - 1 : c + 2] -= 1.5
    return TensorDataset(x, y)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Linear(16 * (SIZE // 4) ** 2, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def warmup_then_decay(warmup: int, total: int) -> Any:
    """LR multiplier: linear warm-up, then linear decay to 10% at the end."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.1, 1.0 - 0.9 * (step - warmup) / max(1, total - warmup))

    return factor


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(
        __doc__.splitlines()[0], sys.argv[1:] if argv is None else argv, epochs=16, samples=2048
    )
    torch.manual_seed(args.seed)
    model = wrap_ddp(ConvNet())
    loader = make_loader(make_data(args.samples, args.seed), args.batch_size, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps = total_steps(loader, args.epochs, args.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay(50, steps))
    guard = Guard(
        model,
        optimizer,
        loss_fn=loss_fn,
        data=loader,
        epochs=args.epochs,
        max_steps=args.max_steps,
        scheduler=scheduler,
        config=GuardConfig(policy=args.policy),
        run_dir=args.run_dir,
    )
    for batch in guard:
        guard.step(batch)
    summary = guard.close()
    return report("convnet", summary, args.quiet, final_loss=summary["final_loss"])


if __name__ == "__main__":
    main()
