"""A Hugging Face `transformers` `TrainerCallback` that puts a `Trainer` under remedy.

    from remedy.integrations.hf import RemedyCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[RemedyCallback()])

The callback reads each forward's inputs (the batch the Trainer hands the
model, for the detectors that read batches: padding, duplicates) and its
loss from the model's output (forward hooks on the inputs and on
`output.loss`), measures the gradients right before the optimizer
step, before clipping (it clips to the Trainer's `max_grad_norm` itself, after
measuring, and drops a non-finite update, as the Guard does), runs the detectors
at the end of the step and applies the policy's in-process actions at the
next step's start on the Trainer's model, optimizer and LR scheduler
(Accelerate's GradScaler is out of its reach). `abort` stops the Trainer. See `remedy.integrations._loop` for what
a rollback means under a loop remedy does not drive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from remedy.integrations._loop import LoopGuard


class RemedyCallback(TrainerCallback):
    """remedy's detectors and remedies inside a `transformers.Trainer`.

    `policy`: a policy file or bundled name (without a supervisor); `run_dir`: where
    the journal, metrics and `summary.json` go; `options`: `LoopGuard`'s own
    (`snapshot_every`, `snapshot_ring`, `detectors`).
    """

    def __init__(
        self, *, policy: str | None = None, run_dir: str | Path | None = None, **options: Any
    ) -> None:
        self.policy = policy
        self.run_dir = run_dir
        self.options = options
        self.guard: LoopGuard | None = None
        self._hooks: list[Any] = []
        self._clip = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        model = kw["model"]
        # The Trainer clips before any callback sees the gradients: the Guard's detectors
        # need the norm before clipping, so the callback clips, right after measuring.
        self._clip = float(args.max_grad_norm or 0.0)
        if self._clip > 0:
            args.max_grad_norm = 0.0
        self.guard = LoopGuard(
            model,
            policy=self.policy,
            run_dir=self.run_dir,
            grad_clip=self._clip if self._clip > 0 else None,
            **self.options,
        )
        self.guard.steps_asked = int(state.max_steps) if state.max_steps else None
        guard = self.guard

        def inspect(module: Any, args: Any, kwargs: Any) -> None:
            # The inputs the Trainer hands the model (`model(**inputs)`): the batch of this
            # forward, for the detectors that read batches. Evaluation's forwards are not
            # training's batches.
            if module.training:
                guard.inspect_batch(kwargs or (args[0] if len(args) == 1 else args))

        def capture(module: Any, inputs: Any, output: Any) -> Any:
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, dict):
                loss = output.get("loss")
            if loss is None or not module.training:
                return None
            changed = guard.chaos_loss(loss)
            guard.record_loss(changed)
            if changed is loss:
                return None
            output["loss"] = changed  # a ModelOutput is a dict too; its attribute follows
            return output

        self._hooks = [
            model.register_forward_pre_hook(inspect, with_kwargs=True),
            model.register_forward_hook(capture),
        ]

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        guard = self._require()
        if guard.optimizer is None:
            guard.attach(kw.get("optimizer"), kw.get("lr_scheduler"))
        guard.begin_step()
        self._stop_if_asked(control)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._require().before_optimizer_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        guard = self._require()
        guard.end_step()
        self._stop_if_asked(control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # The Trainer evaluates (and saves) between steps, before it fetches the next step's
        # batches: that time is not the loader's wait, which starts again after it.
        if self.guard is not None:
            self.guard.this_step.ended()

    on_save = on_evaluate

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._clip > 0:
            args.max_grad_norm = self._clip  # the user's arguments as they were
        if self.guard is not None:
            self.guard.close()

    def _stop_if_asked(self, control: Any) -> None:
        if self.guard is not None and self.guard.stop_reason is not None:
            control.should_training_stop = True

    def _require(self) -> LoopGuard:
        if self.guard is None:
            raise RuntimeError(
                "RemedyCallback: on_train_begin has not run; pass it to Trainer(callbacks=[...])"
            )
        return self.guard
