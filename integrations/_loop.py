"""The Guard's watch and remedies for a training loop that someone else drives.

Hugging Face's `Trainer` and Lightning's `Trainer` own their loops: remedy
cannot call forward and backward itself as `Guard.step` does. `LoopGuard`
takes the loop's own hooks instead — the loss of each forward, the moment
before the optimizer step, the end of the step — and runs the same
detectors, the same policy (in-process, or the supervisor's when run under
`remedy run`) and the same appliers on the loop's model, optimizer,
scheduler and GradScaler.

What differs from a `Guard`: the loop's data position is its own, so a
rollback restores the weights, optimizer, scheduler, scaler and RNG of a
snapshot while the loop's batches go on forward (the batches after the bad
one are not replayed), and `skip_batches` skips the next batches' updates
(their gradients are dropped before the optimizer step).
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from remedy.workers.commands import Command, Outcome
from remedy.workers.context import Reporter, WorkerContext, get_context
from remedy.workers.detectors import DetectorSuite, default_detectors
from remedy.workers.guard import LocalReporter
from remedy.workers.inbox import CommandInbox
from remedy.workers.lr_scale import LRScale
from remedy.workers.measure import GradNorm, MemoryProbe, module_grad_norms
from remedy.workers.snapshots import (
    Snapshot,
    SnapshotRing,
    capture_rng,
    clone_to_host,
    restore_rng,
)
from remedy.workers.stats import StepStats

log = structlog.get_logger("remedy.integrations")

HEARTBEAT_S = 0.5  # longest quiet period between reports, as GuardConfig.heartbeat_s

# In-process actions a framework's loop cannot take, and why (the outcome's detail).
REFUSED_UNDER_FRAMEWORKS: dict[str, str] = {
    "reduce_microbatch": (
        "the framework splits the batch itself (its gradient accumulation setting): "
        "reduce_microbatch cannot change that under a callback"
    ),
    "checkpoint_now": (
        "the framework writes its own checkpoints: remedy keeps no durable checkpoint "
        "under a callback"
    ),
}


class LoopGuard:
    """Detection, decisions and in-process actions for one rank of a framework's loop."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        policy: str | None = None,
        run_dir: str | Path | None = None,
        snapshot_every: int = 10,
        snapshot_ring: int = 6,
        detectors: list[Any] | None = None,
        context: WorkerContext | None = None,
    ) -> None:
        ctx = context or get_context()
        self._ctx = ctx
        self.model = model
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.scaler: Any = None
        self.rank = ctx.rank if ctx else 0
        self.run_dir = Path(run_dir) if run_dir else (ctx.run_dir if ctx else None)
        self.checkpoints = None  # the framework writes its own checkpoints
        self.snapshot_every = snapshot_every
        self.snapshots = SnapshotRing(snapshot_ring)
        self.detectors = DetectorSuite(detectors or default_detectors(model, hardware=False))
        self._owns_reporter = ctx is None or ctx.reporter is None
        self.reporter: Reporter = (
            ctx.reporter if ctx is not None and ctx.reporter is not None else self._local(policy)
        )
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._norm = GradNorm(self._params)
        self._memory = MemoryProbe(self._params[0].device if self._params else torch.device("cpu"))
        self.step_count = 0
        self.tick = 0
        self.lr_cut = LRScale()  # shrink_lr's cuts, in force only during the optimizer step
        self._lr_in_force = contextlib.ExitStack()
        self.inbox = CommandInbox()  # the Guard's inbox: one implementation
        # Remediation state the appliers read; a framework's batches are its own.
        self.micro_batches = 1
        self.max_micro_batches: int | None = None
        self.kv_caches: weakref.WeakSet[Any] = weakref.WeakSet()
        self.kv_allocator = "fixed"
        self._group = (
            dist.group.WORLD
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            else None
        )
        self._group_device = (
            torch.device("cuda", torch.cuda.current_device())
            if self._group is not None and dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        self._recent_stats: deque[StepStats] = deque(maxlen=50)
        self._events: list[dict[str, Any]] = []
        self._metrics: list[dict[str, Any]] = []
        self._losses: list[float] = []
        self._grad_norm = math.nan
        self._skipped = False
        self._skip_left = 0
        self._next_batch = 0
        self._t0 = time.perf_counter()
        self._last_send = 0.0
        self._recent: list[float] = []  # the last 10 losses, for the summary
        self.stop_reason: str | None = None

    def _local(self, policy: str | None) -> Reporter:
        from remedy.policies import Engine, load_policy  # noqa: PLC0415 - standalone only
        from remedy.workers.control import Controller  # noqa: PLC0415
        from remedy.workers.rundir import RunDir  # noqa: PLC0415

        run_id = "local"
        engine = Engine(load_policy(policy or "default"), run_id=run_id)
        run_dir = RunDir(self.run_dir, run_id) if self.run_dir is not None else None
        return LocalReporter(Controller(engine, world_size=1, run_dir=run_dir))

    def attach(self, optimizer: Any, scheduler: Any = None, scaler: Any = None) -> None:
        """The loop's optimizer, LR scheduler and GradScaler, once the framework has made them."""
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        # An LR cut is in force from before_optimizer_step until the optimizer's step returns,
        # before the framework steps its scheduler (which must see the scheduled LR, not the cut).
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps the torch optimizer
        if hasattr(inner, "register_step_post_hook"):
            inner.register_step_post_hook(lambda *_: self._lr_in_force.close())

    # ------------------------------------------------------------- the hooks
    def begin_step(self) -> None:
        """At the boundary before a step: apply due commands, snapshot, start the clock."""
        self.inbox.take(self.reporter.poll())
        if self._group is not None:
            # Every rank applies the same commands at the same boundary (as the Guard does).
            due = self.inbox.due_up_to_seq(self.inbox.agreed_seq(self._group, self._group_device))
        else:
            due = self.inbox.due_at_tick(self.tick)
        self.inbox.apply(due, self)
        if due:
            self._send()
        if self.optimizer is not None and self.step_count % self.snapshot_every == 0:
            steps = self.snapshots.steps()
            if not steps or steps[-1] != self.step_count:
                self.snapshots.push(self.take_snapshot())
        self._losses = []
        self._skipped = False
        self._t0 = time.perf_counter()

    def record_loss(self, loss: Any) -> None:
        """The loss of one forward of this step (several with gradient accumulation)."""
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach().float().mean())
        if isinstance(loss, int | float):
            self._losses.append(float(loss))

    def before_optimizer_step(self) -> bool:
        """Measure the gradients; drop them if the update would be bad or is being skipped.

        Returns True when this step's update is skipped (gradients set to None,
        which torch optimizers treat as "no update").
        """
        self._grad_norm = float(self._norm()) if self._params else math.nan
        loss = self.loss
        bad = not (math.isfinite(loss) and math.isfinite(self._grad_norm))
        if bad or self._skip_left > 0:
            self._skip_left = max(self._skip_left - 1, 0)
            for p in self._params:
                p.grad = None
            self._skipped = True
        else:
            # The framework steps the optimizer next: the cut LR holds for that step only, and
            # end_step puts the scheduled LR back, as the Guard does around its own step.
            self._lr_in_force.enter_context(self.lr_cut.applied(self.optimizer))
        return self._skipped

    @property
    def loss(self) -> float:
        return sum(self._losses) / len(self._losses) if self._losses else math.nan

    def end_step(self) -> None:
        """After the optimizer step: run the detectors, report, count the step."""
        self._lr_in_force.close()  # if the step never ran (a GradScaler skipped it)
        allocated, reserved, capacity = self._memory.read()
        stats = StepStats(
            step=self.step_count,
            tick=self.tick,
            rank=self.rank,
            loss=self.loss,
            grad_norm=self._grad_norm,
            lr=self.lr_cut.effective(float(self.optimizer.param_groups[0]["lr"]))
            if self.optimizer
            else math.nan,
            step_time_s=time.perf_counter() - self._t0,
            loader_time_s=0.0,
            batch_index=self._next_batch,
            loss_scale=float(self.scaler.get_scale())
            if self.scaler is not None and self.scaler.is_enabled()
            else None,
            mem_bytes=allocated,
            mem_reserved_bytes=reserved,
            mem_capacity_bytes=capacity,
            optimizer_skipped=self._skipped,
        )
        events = self.detectors.observe(stats)
        self._events.extend(e.to_dict() for e in events)
        self._metrics.append(stats.to_metrics())
        self._recent_stats.append(stats)
        self._recent = [*self._recent[-9:], stats.loss]
        self._next_batch += 1
        self.step_count += 1
        self.tick += 1
        self._send()

    def close(self) -> dict[str, Any]:
        """Flush the last report; close the in-process journal; return this rank's totals."""
        self._send(wait=True)
        summary = {
            "rank": self.rank,
            "status": "aborted" if self.stop_reason else "completed",
            "stop_reason": self.stop_reason,
            "steps_completed": self.step_count,
            "steps_executed": self.tick,
            "final_loss": self._final_loss(),
        }
        ctx = self._ctx
        if ctx is not None:
            ctx.summary = summary  # what a supervised rank returns (as a Guard's close does)
        if self._owns_reporter:
            self.reporter.close()
        return summary

    def _final_loss(self) -> float | None:
        losses = [v for m in self._recent[-10:] if math.isfinite(v := float(m))]
        return sum(losses) / len(losses) if losses else None

    def _send(self, *, wait: bool = False) -> None:
        now = time.monotonic()
        # Like a Guard: report at once when there is news, else at most every HEARTBEAT_S.
        if (
            not (wait or self._events or self.inbox.has_unsent)
            and now - self._last_send < HEARTBEAT_S
        ):
            return
        self._last_send = now
        batch = {
            "rank": self.rank,
            "step": self.step_count,
            "tick": self.tick,
            "ts": time.time(),
            "events": self._events,
            "metrics": self._metrics,
            "outcomes": self.inbox.drain_outcomes(),
        }
        self._events, self._metrics = [], []
        self.reporter.send(batch, wait=wait)

    # ------------------------------------ what the appliers call (Guard's API)
    def take_snapshot(self) -> Snapshot:
        return Snapshot(
            step=self.step_count,
            tick=self.tick,
            cursor=self._next_batch,
            model=clone_to_host(self.model.state_dict()),
            optimizer=clone_to_host(self.optimizer.state_dict()),
            scheduler=clone_to_host(self.scheduler.state_dict()) if self.scheduler else None,
            scaler=self.scaler.state_dict() if self.scaler is not None else None,
            rng=capture_rng(),
            lr_scale=self.lr_cut.scale,
        )

    def restore(self, snap: Snapshot) -> None:
        """Weights, optimizer, scheduler, scaler and RNG back to `snap`; remediations stay in force.

        The step goes back with them; the loop's data position does not (`data_rewindable`).
        """
        self.model.load_state_dict(snap.model)
        # Loading may alias the given tensors; the snapshot must stay pristine for a second rollback.
        self.optimizer.load_state_dict(clone_to_host(snap.optimizer))
        if self.scheduler is not None and snap.scheduler is not None:
            self.scheduler.load_state_dict(clone_to_host(snap.scheduler))
        if self.scaler is not None and snap.scaler is not None:
            self.scaler.load_state_dict(snap.scaler)
        restore_rng(snap.rng)
        self.step_count = snap.step
        self.snapshots.drop_after(snap.step)
        self.detectors.reset()
        self.optimizer.zero_grad(set_to_none=True)

    def scale_lr(self, factor: float, *, min_lr: float = 0.0) -> None:
        self.lr_cut.cut(factor, min_lr=min_lr)

    @property
    def lr_scale(self) -> float:
        return self.lr_cut.scale

    def effective_lrs(self) -> list[float]:
        return self.lr_cut.effective_lrs(self.optimizer)

    @property
    def history(self) -> deque[Outcome]:
        """Every applied or failed command, newest last."""
        return self.inbox.history

    @property
    def group(self) -> Any:
        return self._group

    @property
    def data_rewindable(self) -> bool:
        return False  # the framework owns the data position: a rollback says so in its outcome

    @property
    def device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    def refusal(self, action: str) -> str | None:
        """Why a framework's loop cannot take `action`, or None."""
        return REFUSED_UNDER_FRAMEWORKS.get(action)

    def checkpoint_extra(self) -> dict[str, Any]:
        return {}

    def submit(self, command: Command) -> None:
        """Queue a command by hand (an operator's intervention, a test); applied like any other."""
        self.inbox.submit(command)

    def skip_next(self, count: int) -> list[int]:
        """Drop the updates of the loop's next `count` batches; returns their positions."""
        self._skip_left += count
        return list(range(self._next_batch, self._next_batch + count))

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def module_grad_norms(self) -> dict[str, float]:
        return module_grad_norms(self.model)

    @property
    def recent_stats(self) -> deque[StepStats]:
        return self._recent_stats
