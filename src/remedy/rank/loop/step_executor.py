"""One training step's arithmetic, as the Guard runs it and a replay repeats it.

`StepExecutor` owns the model, optimizer, scheduler and GradScaler the user
handed the Guard, and does what a step does to them: the forward and
backward over the batch's micro-batches (the split `Remediation` says), under
autocast and the saved-activation cap when configured, with DDP's and FSDP's
gradient sync on the last micro-batch only; unscaling, the global gradient
norm and clipping; one host read of the loss, the norm and the command
agreement's number; and the optimizer step the values allow, with an LR cut
in force while it runs and the scheduler after it.

No detectors, reports, commands or recovery: the Guard runs those around
it, at the step's boundaries. Chaos faults that act on the loss, the
gradients or the step go through the FaultInjector it is given.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from remedy.rank.actions.activation_checkpointing import SavedActivationCap
from remedy.rank.loop.measure import GradNorm
from remedy.rank.state import sharding

if TYPE_CHECKING:
    from remedy.rank.actions.remediation import Remediation
    from remedy.rank.chaos.faults import FaultInjector

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True, slots=True)
class StepSettings:
    """What a step runs under (from `GuardConfig`)."""

    amp_dtype: torch.dtype | None = None
    activation_cap_bytes: int | None = None
    grad_clip: float | None = None


class StepExecutor:
    """Forward, backward, norm, clipping and the optimizer step of one rank."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: LossFn,
        scheduler: Any | None,
        scaler: torch.amp.GradScaler | None,
        settings: StepSettings,
        remediation: Remediation,
        injector: FaultInjector,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        # A sharded (FSDP2/HSDP) model's tensors are DTensors: norms go by shard, and
        # overflows must be agreed over the group (a sharded scaler).
        self.sharded = sharding.is_sharded(model)
        self.scaler = sharding.sharded_scaler(scaler) if self.sharded else scaler
        self._grad_norm = sharding.grad_norm_for(self.params) or GradNorm(self.params)
        self.settings = settings
        self.remediation = remediation
        self.injector = injector
        self.batch_index = -1  # the index of the batch the next forward trains on

    @property
    def scaled(self) -> bool:
        """Whether a GradScaler in force scales the loss (AMP with float16)."""
        return self.scaler is not None and self.scaler.is_enabled()

    def forward_backward(
        self, batch: Any, step: int, *, model: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """Forward and backward over `batch`'s micro-batches; the loss (detached).

        `model`: what runs the forward (a replay checks a rank's batch on the module
        a DDP wrapper holds, so that no collective runs); the executor's model by default.
        """
        model = self.model if model is None else model
        self.injector.stepping(step)
        self.remediation.max_micro_batches = batch_size(batch)
        chunks = split(batch, self.remediation.micro_batches)
        total: torch.Tensor | None = None
        # DDP, FSDP2: reduce gradients once, on the last chunk
        no_sync = getattr(model, "no_sync", None) or sharding.no_sync_of(model)
        for i, (chunk, weight) in enumerate(chunks):
            sync = (
                no_sync()
                if no_sync is not None and i < len(chunks) - 1
                else contextlib.nullcontext()
            )
            with sync:
                with contextlib.ExitStack() as forward:
                    if self.settings.amp_dtype is not None:
                        forward.enter_context(
                            torch.autocast(self.device.type, dtype=self.settings.amp_dtype)
                        )
                    if self.settings.activation_cap_bytes is not None:
                        forward.enter_context(
                            SavedActivationCap(self.settings.activation_cap_bytes)
                        )
                    loss = self.loss_fn(model, chunk)
                    if weight != 1.0:
                        loss = loss * weight
                loss = self.injector.on_loss(step, self.batch_index, loss)
                scaled = self.scaler.scale(loss) if self.scaler is not None else loss
                scaled.backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return total

    def finish_grads(self, step: int) -> torch.Tensor:
        """After backward: chaos's gradient faults, unscaling, the global norm, clipping.

        Returns the norm (before clipping) as a device tensor. A replay runs the
        same sequence, so its gradients are the ones the optimizer would see.
        """
        self.injector.on_grads(step, self.params)
        if self.scaled:
            assert self.scaler is not None
            self.scaler.unscale_(self.optimizer)
        norm_t = self._grad_norm()
        if self.settings.grad_clip is not None:
            coef = (self.settings.grad_clip / (norm_t + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(sharding.local_grads(self.params), coef)
        return norm_t

    @staticmethod
    def read(
        loss: torch.Tensor, norm_t: torch.Tensor, seq_t: torch.Tensor | None
    ) -> tuple[float, float, float | None]:
        """The loss, the norm and the agreement's number on the host: one device sync."""
        loss_v, norm_v, (seq_v,) = StepExecutor.read_all(loss, norm_t, [seq_t])
        return loss_v, norm_v, seq_v[0] if seq_v is not None else None

    @staticmethod
    def read_all(
        loss: torch.Tensor, norm_t: torch.Tensor, more: list[torch.Tensor | None]
    ) -> tuple[float, float, list[list[float] | None]]:
        """The loss, the norm and each of `more` (None stays None) on the host: one device sync."""
        if loss.device.type == "cpu" and norm_t.device.type == "cpu":
            # No device to wait for: plain reads.
            plain = [t.reshape(-1).tolist() if t is not None else None for t in more]
            return loss.item(), norm_t.item(), plain
        read = [loss.detach().double().reshape(1), norm_t.to(loss.device).double().reshape(1)]
        read += [t.to(loss.device).double().reshape(-1) for t in more if t is not None]
        flat = torch.cat(read).tolist()
        loss_v, norm_v, at = flat[0], flat[1], 2
        out: list[list[float] | None] = []
        for t in more:
            if t is None:
                out.append(None)
                continue
            n = t.numel()
            out.append(flat[at : at + n])
            at += n
        return loss_v, norm_v, out

    def optimizer_step(self, loss_v: float, norm_v: float) -> bool:
        """Step unless something non-finite would be applied; True when skipped."""
        if self.scaled:
            assert self.scaler is not None
            if not math.isfinite(loss_v):
                # The scaler only checks gradients; a NaN loss must not reach the weights either.
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                return True
            scale_before = self.scaler.get_scale()
            with self.remediation.lr_cut.applied(self.optimizer):
                self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale_before
        elif not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            skipped = True
        else:
            with self.remediation.lr_cut.applied(self.optimizer):
                self.optimizer.step()
            skipped = False
        if not skipped and self.scheduler is not None:
            if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                # It needs a metric; the training loss is the one the Guard has.
                self.scheduler.step(loss_v)
            else:
                self.scheduler.step()
        return skipped


def batch_size(batch: Any) -> int | None:
    """The batch's leading dimension, where it has one (the most micro-batches it splits into)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, tuple | list) and batch and isinstance(batch[0], torch.Tensor):
        return int(batch[0].shape[0])
    if isinstance(batch, dict) and batch:
        first = next(iter(batch.values()))
        return int(first.shape[0]) if isinstance(first, torch.Tensor) else None
    return None


def split(batch: Any, parts: int) -> list[tuple[Any, float]]:
    """Split a batch along dim 0 into micro-batches with their loss weights."""
    if parts <= 1:
        return [(batch, 1.0)]
    if isinstance(batch, torch.Tensor):
        chunks = list(batch.chunk(parts))
        n = batch.shape[0]
        return [(c, c.shape[0] / n) for c in chunks]
    if isinstance(batch, tuple | list):
        columns = [list(t.chunk(parts)) for t in batch]
        n = batch[0].shape[0]
        return [
            (type(batch)(col[i] for col in columns), columns[0][i].shape[0] / n)
            for i in range(len(columns[0]))
        ]
    if isinstance(batch, dict):
        keys = list(batch)
        by_key = {k: list(batch[k].chunk(parts)) for k in keys}
        n = batch[keys[0]].shape[0]
        count = len(by_key[keys[0]])
        return [
            ({k: by_key[k][i] for k in keys}, by_key[keys[0]][i].shape[0] / n) for i in range(count)
        ]
    raise TypeError(f"cannot split a {type(batch).__name__} batch into micro-batches")
