"""A tiny Lightning job run supervised by test_lightning.py (`lightning_train.py:main`).

The module's loss is NaN at the 15th training step; the callback reports to
the rank's supervisor, whose policy rolls it back.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_builders import quiet_trainer
from test_lightning import STEPS, Regression, data

from remedy.integrations.lightning import RemedyCallback


def main() -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    module = Regression()
    callback = RemedyCallback()
    trainer = quiet_trainer(STEPS, [callback])
    trainer.fit(module, data())
    return {
        "global_step": trainer.global_step,
        "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters()),
    }
