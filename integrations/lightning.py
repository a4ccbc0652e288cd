"""A Lightning `Callback` that puts a `lightning.Trainer` under remedy.

    from remedy.integrations.lightning import RemedyCallback
    trainer = lightning.Trainer(max_steps=1000, callbacks=[RemedyCallback()])

The loss is the one `training_step` returns (taken before its backward);
the gradients are measured in
`on_before_optimizer_step` (a non-finite update is dropped there, as the
Guard does); the detectors run after each batch and the policy's
in-process actions are applied before the next one on the Trainer's
optimizer, LR scheduler and precision plugin's GradScaler. `abort` stops
the Trainer. See `remedy.integrations._loop` for what a rollback means
under a loop remedy does not drive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning

from remedy.integrations._loop import LoopGuard


class RemedyCallback(lightning.Callback):
    """remedy's detectors and remedies inside a `lightning.Trainer` (automatic optimization)."""

    def __init__(
        self, *, policy: str | None = None, run_dir: str | Path | None = None, **options: Any
    ) -> None:
        self.policy = policy
        self.run_dir = run_dir
        self.options = options
        self.guard: LoopGuard | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.guard = LoopGuard(pl_module, policy=self.policy, run_dir=self.run_dir, **self.options)
        scheduler = (
            trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.guard.attach(trainer.optimizers[0], scheduler, scaler)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        guard = self._require()
        guard.begin_step()
        if guard.stop_reason is not None:
            trainer.should_stop = True

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        # Before the optimizer step, which must know whether the loss is finite.
        self._require().record_loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._require().before_optimizer_step()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        guard = self._require()
        guard.end_step()
        if guard.stop_reason is not None:
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.guard is not None:
            self.guard.close()

    def _require(self) -> LoopGuard:
        if self.guard is None:
            raise RuntimeError(
                "RemedyCallback: on_train_start has not run; pass it to Trainer(callbacks=[...])"
            )
        return self.guard
