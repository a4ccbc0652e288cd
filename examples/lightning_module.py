"""Train a small LightningModule under remedy: one callback.

    python examples/lightning_module.py --run-dir runs/lightning   # then: remedy report runs/lightning

A regression MLP on generated data; `--nan-at N` makes the N-th training
step's loss NaN, to watch remedy drop that update, roll back and cut the
LR. Needs the extra: pip install "remedy[lightning]".
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning
import torch
from torch import nn

from remedy.integrations.lightning import RemedyCallback


class Regression(lightning.LightningModule):
    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        # A linear path beside the MLP: the target is linear, so the fit reaches the noise
        # floor and no batch stays much harder than the others (which would read as spikes).
        self.skip = nn.Linear(16, 1)
        self.nan_at = nan_at
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss((self.net(x) + self.skip(x)).float(), y)
        self.calls += 1
        if self.calls == self.nan_at:
            loss = loss * float("nan")  # an injected bad batch
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.005 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None) -> dict[str, int]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--nan-at", type=int, default=100, help="the training step whose loss is NaN; 0: none"
    )
    p.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--precision", default="32-true", help="e.g. bf16-mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/lightning")
    args = p.parse_args(argv)

    lightning.seed_everything(args.seed, verbose=False)
    g = torch.Generator().manual_seed(args.seed)
    # Uniform inputs of unit variance: no batch holds a far outlier (a Gaussian's tail would
    # make a few batches' loss several times the rest, spikes the detectors rightly report).
    x = (torch.rand(32 * args.steps, 16, generator=g) * 2 - 1) * 3**0.5
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(32 * args.steps, 1, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    trainer = lightning.Trainer(
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        precision=args.precision,
        gradient_clip_val=1.0,
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[RemedyCallback(run_dir=args.run_dir)],  # the one line remedy needs
    )
    trainer.fit(Regression(args.nan_at), loader)
    print(f"done: {trainer.global_step} steps; journal in {args.run_dir}/decisions.jsonl")
    return {"global_step": int(trainer.global_step)}


if __name__ == "__main__":
    main()
