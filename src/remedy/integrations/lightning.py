"""A Lightning `Callback` that puts a `lightning.Trainer` under remedy.

    from remedy.integrations.lightning import RemedyCallback
    trainer = lightning.Trainer(max_steps=1000, callbacks=[RemedyCallback()])

The loss is the one `training_step` returns (taken before its backward);
each batch Lightning hands over goes to the detectors that read batches
(`on_train_batch_start`); the loader's wait is the time the fit loop's
fetches take (`_lightning_fetch`), so a stall in Lightning's prefetch, or
between the micro-batches of one step, is a loader wait and not step time;
the gradients are measured in
`on_before_optimizer_step`, before Lightning clips (a non-finite update is
dropped there, as the Guard does); with gradient accumulation one step is
the batches of one optimizer step. The detectors run after each step and the policy's
in-process actions are applied before the next one on the Trainer's
optimizer, LR scheduler and precision plugin's GradScaler. `abort` stops
the Trainer. See `remedy.integrations._loop` for what a rollback means
under a loop remedy does not drive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning
import torch

from remedy.integrations._lightning_fetch import FetchTimer, time_fetches
from remedy.integrations._loop import LoopGuard


class RemedyCallback(lightning.Callback):
    """remedy's detectors and remedies inside a `lightning.Trainer` (automatic optimization).

    `policy`: a policy file or bundled name (without a supervisor); `run_dir`: where
    the journal, metrics and `summary.json` go; `options`: `LoopGuard`'s own
    (`snapshot_every`, `snapshot_ring`, `detectors`). Rollbacks move `max_steps`
    on by the steps they undid, so the asked-for logical steps are trained.
    """

    def __init__(
        self, *, policy: str | None = None, run_dir: str | Path | None = None, **options: Any
    ) -> None:
        self.policy = policy
        self.run_dir = run_dir
        self.options = options
        self.guard: LoopGuard | None = None
        self._asked: int | None = None
        self._open = False  # a step has begun and its optimizer step has not ended it yet
        self._stepped = False
        self._unwrap: tuple[Any, Any] | None = None
        self._fetches: FetchTimer | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.guard = LoopGuard(pl_module, policy=self.policy, run_dir=self.run_dir, **self.options)
        scheduler = (
            trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.guard.attach(trainer.optimizers[0], scheduler, scaler)
        self._asked = (
            int(trainer.max_steps) if trainer.max_steps and trainer.max_steps > 0 else None
        )
        self.guard.steps_asked = self._asked
        # Chaos loss faults act on what training_step returns, before Lightning's backward.
        guard, step_fn = self.guard, pl_module.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            out = step_fn(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                return guard.chaos_loss(out)
            if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
                return {**out, "loss": guard.chaos_loss(out["loss"])}
            return out

        if guard.injector.faults:
            pl_module.training_step = training_step
            self._unwrap = (pl_module, step_fn)
        self._fetches = time_fetches(trainer, guard.this_step)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        guard = self._require()
        # With gradient accumulation a step spans several batches: it begins at the first.
        if not self._open:
            guard.begin_step()
            self._open, self._stepped = True, False
            self._train_asked_steps(trainer)
        guard.inspect_batch(batch)  # each micro-batch, as the Guard inspects each batch
        if guard.stop_reason is not None:
            trainer.should_stop = True

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        # Before the optimizer step, which must know whether the loss is finite. Lightning
        # divides each micro-batch's loss by the accumulation count: undo that here.
        self._require().record_loss(loss * trainer.accumulate_grad_batches)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._require().before_optimizer_step()
        self._stepped = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        guard = self._require()
        if self._stepped:  # the optimizer stepped: the step is over (not a mere micro-batch)
            guard.end_step()
            self._open = False
        if guard.stop_reason is not None:
            trainer.should_stop = True

    def _train_asked_steps(self, trainer: Any) -> None:
        """Keep training until the asked-for number of logical steps is trained.

        Lightning's `max_steps` counts optimizer steps executed; a rollback takes the
        logical step back (and the LR schedule with it, restored from the snapshot), so
        the limit moves on by the steps the rollbacks undid.
        """
        guard = self._require()
        if self._asked is None:
            return
        want = trainer.global_step + (self._asked - guard.step_count)
        if want != trainer.fit_loop.epoch_loop.max_steps:
            trainer.fit_loop.epoch_loop.max_steps = want

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._unwrap is not None:
            module, step_fn = self._unwrap
            module.training_step = step_fn
        if self._fetches is not None:
            self._fetches.remove()
            self._fetches = None
        if self.guard is not None:
            self.guard.close()

    def _require(self) -> LoopGuard:
        if self.guard is None:
            raise RuntimeError(
                "RemedyCallback: on_train_start has not run; pass it to Trainer(callbacks=[...])"
            )
        return self.guard
