"""A Lightning DDP job with remedy's callback, as torchrun runs it (no remedy supervisor).

    torchrun --nproc_per_node 2 tests/integrations/launched_lightning.py --run-dir runs/t --steps 30

Lightning forms the gloo group from torchrun's environment (its
`TorchElasticEnvironment`); the callback finds the group and no supervisor,
so rank 0 decides for both ranks. Each rank writes its parameters and the
commands it applied to the run directory's `out/` when the fit ends, for
test_callbacks_torchrun.py to compare.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning
import torch
from torch import nn

from remedy.integrations.lightning import RemedyCallback
from tests.integrations.launched_job import parse_args, write_rank_out
from tests.integrations.lightning_builders import quiet_trainer

SAMPLES, FEATURES = 2048, 8


class Regression(lightning.LightningModule):  # type: ignore[misc]
    """y = tanh(x @ w) on generated data, under DDP."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, 1, generator=g)).tanh()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def main(argv: list[str]) -> None:
    args = parse_args(argv, __doc__.splitlines()[0])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    module = Regression()
    callback = RemedyCallback(run_dir=args.run_dir, snapshot_every=5)
    trainer = quiet_trainer(
        args.steps, [callback], devices=2, strategy="ddp", default_root_dir=args.run_dir
    )
    trainer.fit(module, data())
    write_rank_out(args.run_dir, callback, module.state_dict())


if __name__ == "__main__":
    main(sys.argv[1:])
