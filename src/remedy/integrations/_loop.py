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
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from remedy.integrations._agree import LoopAgreement
from remedy.policies._vocab import ACTION_TABLE
from remedy.protocol.commands import Command, Outcome
from remedy.rank.actions.remediation import Remediation
from remedy.rank.chaos.faults import ChaosSetting, FaultInjector, refuse_under_frameworks
from remedy.rank.detectors import DetectorSuite, default_detectors
from remedy.rank.guard import LocalReporter
from remedy.rank.link import group_decide
from remedy.rank.link.context import Reporter, WorkerContext, get_context
from remedy.rank.link.group_decide import GroupReporter
from remedy.rank.link.inbox import CommandInbox
from remedy.rank.link.outbox import Outbox
from remedy.rank.loop.learning import LearningTracker
from remedy.rank.loop.measure import GradNorm, MemoryProbe, module_grad_norms
from remedy.rank.loop.stats import StepStats
from remedy.rank.state.snapshots import (
    Snapshot,
    SnapshotRing,
    capture_rng,
    clone_to_host,
    restore_rng,
)

log = structlog.get_logger("remedy.integrations")

HEARTBEAT_S = 0.5  # longest quiet period between reports, as GuardConfig.heartbeat_s

# In-process actions a framework's loop cannot take, and why (the outcome's detail).
REFUSED_UNDER_FRAMEWORKS: dict[str, str] = {
    a.name: a.under_callbacks for a in ACTION_TABLE if a.under_callbacks is not None
}


class LoopStep:
    """One step of a framework's loop, measured around its hooks: the losses of its forwards,
    the global gradient norm before clipping, whether its update was dropped, its time, and
    the loader's wait before it (from the end of the step before)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._norm = GradNorm(params) if params else None
        self.losses: list[float] = []
        self.grad_norm = math.nan
        self.dropped = False  # this step's update is skipped
        self.ordered_skip = False  # ... on a command's order (skip_batches)
        self.loader_s = 0.0
        self._started = time.perf_counter()
        self._ended: float | None = None  # when the step before ended: the loader's wait starts
        # Where the framework's fetches are timed (Lightning's, `fetch_began`/`fetch_ended`):
        # their total since the last mark, and when the one under way began.
        self._timed = False
        self._waited = 0.0
        self._fetch_began: float | None = None

    def fetch_began(self) -> None:
        """The framework starts fetching a batch: from now on the loader's wait is the time
        its fetches take, wherever they fall (between steps, or between the micro-batches of
        one step), never the time between steps (an evaluation, a save)."""
        self._timed = True
        self._fetch_began = time.perf_counter()

    def fetch_ended(self) -> None:
        """The fetch that `fetch_began` marked has returned its batch."""
        if self._fetch_began is not None:
            self._waited += time.perf_counter() - self._fetch_began
            self._fetch_began = None

    def boundary_took(self, seconds: float) -> None:
        """The boundary's own work before this step (the inbox read, the group's agreement on
        commands, which waits for the latest peer, the commands applied and sent) took
        `seconds`: that is not the loader's wait, which an untimed fetch measures from the end
        of the step before."""
        if self._ended is not None:
            self._ended += seconds

    def fetched(self) -> None:
        """The framework fetched this step's batch since the last step ended: that is the
        loader's wait, as its fetches were timed, else the whole time since the last step
        ended (with the framework's own bookkeeping, small beside a stall)."""
        if self._timed:
            self.loader_s, self._waited = self._waited, 0.0
        else:
            self.loader_s = time.perf_counter() - self._ended if self._ended is not None else 0.0

    @property
    def loader_time_s(self) -> float:
        """The step's loader wait: before it, and in it (the fetches of its later micro-batches)."""
        return self.loader_s + self._waited

    def begin(self) -> None:
        """The step starts now: no loss yet, nothing dropped."""
        self.losses = []
        self.ordered_skip = False
        self.dropped = False
        self._started = time.perf_counter()

    def record_loss(self, loss: Any) -> None:
        """The loss of one forward of this step (several with gradient accumulation)."""
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach().float().mean())
        if isinstance(loss, int | float):
            self.losses.append(float(loss))

    @property
    def loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else math.nan

    def measure_grads(self) -> torch.Tensor | None:
        """The global gradient norm (kept as `grad_norm`); the tensor, for clipping."""
        norm_t = self._norm() if self._norm is not None else None
        self.grad_norm = float(norm_t) if norm_t is not None else math.nan
        return norm_t

    @property
    def finite(self) -> bool:
        """Whether the step's loss and gradient norm are both finite (its update may go on)."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)

    @property
    def elapsed_s(self) -> float:
        """The step's time, less the fetches timed in it (they are the loader's wait)."""
        return time.perf_counter() - self._started - self._waited

    def ended(self) -> None:
        """The step is over, reported and all: the loader's wait for the next starts."""
        self._ended = time.perf_counter()
        self._waited = 0.0


class LoopCursor:
    """The loop's batch position, as far as remedy can know it, and the updates it dropped.

    The framework owns the data: remedy counts the batches the loop's steps
    took (`batch`), drops the updates of the next batches a `skip_batches`
    asks for (`skip_next`), and drops any update whose loss or gradient norm
    is not finite (`drop`).
    """

    def __init__(self) -> None:
        self.batch = 0  # the loop's next batch, counted from its first
        self.skipped_updates: set[int] = set()  # logical steps whose update was dropped
        self.skipped_batches: list[int] = []  # steps dropped because a command asked it
        self._left = 0  # updates still to drop for `skip_next`

    def skip_next(self, count: int) -> list[int]:
        """Drop the updates of the loop's next `count` batches; returns their positions."""
        self._left += count
        return list(range(self.batch, self.batch + count))

    @property
    def skipping(self) -> bool:
        """Whether the next update is dropped on a command's order (`skip_next`)."""
        return self._left > 0

    def drop(self, step: int, *, bad: bool) -> bool:
        """Whether the update of logical step `step` is dropped (`bad`: it is not finite)."""
        if not (bad or self._left > 0):
            return False
        if self._left > 0:
            self.skipped_batches.append(step)
            self._left -= 1
        self.skipped_updates.add(step)
        return True

    def advance(self) -> None:
        """The step took its batch."""
        self.batch += 1

    def rewound(self, step: int) -> None:
        """A rollback to logical step `step`: the updates dropped from there on are undone."""
        self.skipped_updates = {s for s in self.skipped_updates if s < step}


class LoopGuard:
    """Detection, decisions and in-process actions for one rank of a framework's loop.

    Its parts: the step measured (`LoopStep`), the loop's batch position and
    dropped updates (`LoopCursor`), the Guard's command inbox and outbox, the
    remediations in force, the snapshot ring, the detectors and the chaos
    injector.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        policy: str | None = None,
        run_dir: str | Path | None = None,
        snapshot_every: int = 10,
        snapshot_ring: int = 6,
        detectors: list[Any] | None = None,
        grad_clip: float | None = None,
        context: WorkerContext | None = None,
    ) -> None:
        """`grad_clip`: clip the global gradient norm to this after measuring it (the
        framework's own clipping is then turned off by the callback, so the detectors
        see the norm before clipping, as under a Guard)."""
        ctx = context or get_context()
        self._ctx = ctx
        if ctx is not None and ctx.membership is not None:
            ctx.membership.framework_loop()  # a lost peer ends this rank: it is replaced
        self.model = model
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.scaler: Any = None
        self.rank = ctx.rank if ctx else 0
        self.run_dir = Path(run_dir) if run_dir else (ctx.run_dir if ctx else None)
        self.checkpoints = None  # the framework writes its own checkpoints
        self.snapshot_every = snapshot_every
        self.snapshots = SnapshotRing(snapshot_ring)
        # The Guard's own suite: its hardware monitor is on where NVML finds a GPU (off, with
        # one line in the log, elsewhere), its batch inspectors see the batches the
        # framework hands over (`inspect_batch`).
        self.detectors = DetectorSuite(detectors or default_detectors(model))
        self._batch_inspectors: list[Any] = [
            d for d in self.detectors.detectors if callable(getattr(d, "inspect_batch", None))
        ]
        self._owns_reporter = ctx is None or ctx.reporter is None
        self.reporter: Reporter = (
            ctx.reporter if ctx is not None and ctx.reporter is not None else self._local(policy)
        )
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.this_step = LoopStep(self._params)
        self.cursor = LoopCursor()
        self._memory = MemoryProbe(self._params[0].device if self._params else torch.device("cpu"))
        self.step_count = 0
        self.tick = 0
        # What actions changed (LR cuts, in force only during the optimizer step; the rest is read
        # by the appliers: a framework's batches and caches are its own).
        self.remediation = Remediation()
        self._lr_in_force = contextlib.ExitStack()
        self.inbox = CommandInbox()  # the Guard's inbox and outbox: one implementation
        self.outbox = Outbox(self.reporter, self.inbox, rank=self.rank, heartbeat_s=HEARTBEAT_S)
        # Which commands are due, agreed by every rank (decided once under a launcher).
        self.agreement = LoopAgreement(ctx, self.reporter, self.rank)
        self._group = self.agreement.agreement.group if self.agreement.agreement else None
        self._recent_stats: deque[StepStats] = deque(maxlen=50)
        self.learning = LearningTracker()  # the summary's `learning` (see the Guard's)
        self.grad_clip = grad_clip
        faults = ctx.faults if ctx is not None else []
        refuse_under_frameworks(faults)
        self.injector = FaultInjector(
            faults,
            self.rank,
            run_dir=self.run_dir,
            kill_supervisor=getattr(self.reporter, "kill_supervisor", None),
            kill_node=getattr(self.reporter, "kill_node", None),
        )
        # A fault that cannot fire here is refused before the first step, never a no-op.
        self.injector.check(
            ChaosSetting(
                world_size=ctx.world_size if ctx is not None else 1,
                supervised=getattr(self.reporter, "kill_supervisor", None) is not None,
            )
        )
        self.steps_asked: int | None = None  # the framework's max_steps, told by the callback
        self.stop_reason: str | None = None
        self._closed: dict[str, Any] | None = None

    def _local(self, policy: str | None) -> Reporter:
        from remedy.control.decide import Controller  # noqa: PLC0415
        from remedy.policies import Engine, load_policy  # noqa: PLC0415 - standalone only
        from remedy.policies._loader import BUNDLED  # noqa: PLC0415
        from remedy.policies._loops import for_loop, refused_steps  # noqa: PLC0415
        from remedy.rundir.writer import RunDir  # noqa: PLC0415

        ctx = self._ctx
        run_id = ctx.run_id if ctx is not None else "local"
        rules = load_policy(policy or "default")
        if (policy or "default") in BUNDLED:
            # The bundled policies are written for the Guard: their callback version
            # leaves out the steps a framework's loop cannot take (policies._loops).
            rules = for_loop(rules, "callbacks")
        # What `remedy policy check --loop callbacks` refuses: said once, before training,
        # rather than only as a failed outcome when such a rule fires.
        refused = refused_steps(rules, "callbacks")
        if refused:
            log.warning(
                "policy_steps_refused_under_callbacks",
                policy=rules.name,
                steps=[x.describe() for x in refused],
            )
        engine = Engine(rules, run_id=run_id)
        run_dir = RunDir(self.run_dir, run_id) if self.run_dir is not None else None
        if ctx is not None and ctx.launcher is not None:
            # Ranks that torchrun (or another launcher) started: rank 0 decides for the group.
            return group_decide.reporter_for(ctx, engine, run_dir)
        return LocalReporter(
            Controller(engine, world_size=1, journal=run_dir is not None), run_dir=run_dir
        )

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
        began = time.perf_counter()
        self.inbox.take(self.reporter.poll())
        # Every rank applies the same commands at the same boundary (as the Guard does).
        due = self.agreement.due(self.inbox, tick=self.tick, target=self)
        self.inbox.apply(due, self)
        if due:
            self._send()
        self.this_step.boundary_took(time.perf_counter() - began)
        self.injector.before_batch(self.step_count)
        self.this_step.fetched()
        self.injector.before_step(self.step_count)
        if self.optimizer is not None and self.step_count % self.snapshot_every == 0:
            steps = self.snapshots.steps()
            if not steps or steps[-1] != self.step_count:
                self.snapshots.push(self.take_snapshot())
        self.this_step.begin()

    def inspect_batch(self, batch: Any) -> None:
        """The batch the framework hands over for this step's forward (each micro-batch's):
        the detectors that look at batches (padding, duplicates) read it, as under a Guard."""
        for inspector in self._batch_inspectors:
            inspector.inspect_batch(batch)

    def record_loss(self, loss: Any) -> None:
        """The loss of one forward of this step (several with gradient accumulation)."""
        self.this_step.record_loss(loss)

    def before_optimizer_step(self) -> bool:
        """Measure the gradients; drop them if the update would be bad or is being skipped.

        Returns True when this step's update is skipped (gradients set to None,
        which torch optimizers treat as "no update").
        """
        self.injector.on_grads(self.step_count, self._params)
        step = self.this_step
        norm_t = step.measure_grads()
        # An update dropped on a command's order (skip_batches) is a remedy at work, not a
        # run that stopped learning (rank.loop.learning reads `skipped_batch`).
        step.ordered_skip = self.cursor.skipping
        if self.cursor.drop(self.step_count, bad=not step.finite):
            for p in self._params:
                p.grad = None
            step.dropped = True
        else:
            if self.grad_clip is not None and norm_t is not None:
                coef = (self.grad_clip / (norm_t + 1e-6)).clamp(max=1.0)
                torch._foreach_mul_([p.grad for p in self._params if p.grad is not None], coef)
            # The framework steps the optimizer next: the cut LR holds for that step only, and
            # end_step puts the scheduled LR back, as the Guard does around its own step.
            self._lr_in_force.enter_context(self.remediation.lr_cut.applied(self.optimizer))
        return step.dropped

    def chaos_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This step's loss with the chaos file's loss faults applied (the loss itself if none)."""
        return self.injector.on_loss(self.step_count, self.cursor.batch, loss)

    @property
    def loss(self) -> float:
        return self.this_step.loss

    def end_step(self) -> None:
        """After the optimizer step: run the detectors, report, count the step."""
        self._lr_in_force.close()  # if the step never ran (a GradScaler skipped it)
        allocated, reserved, capacity = self._memory.read()
        step = self.this_step
        stats = StepStats(
            step=self.step_count,
            tick=self.tick,
            rank=self.rank,
            loss=step.loss,
            grad_norm=step.grad_norm,
            lr=self.remediation.lr_cut.effective(float(self.optimizer.param_groups[0]["lr"]))
            if self.optimizer
            else math.nan,
            step_time_s=step.elapsed_s,
            loader_time_s=step.loader_time_s,
            batch_index=self.cursor.batch,
            loss_scale=float(self.scaler.get_scale())
            if self.scaler is not None and self.scaler.is_enabled()
            else None,
            mem_bytes=allocated,
            mem_reserved_bytes=reserved,
            mem_capacity_bytes=capacity,
            optimizer_skipped=step.dropped,
            grad_clip=self.grad_clip,
            extra={"skipped_batch": True} if step.ordered_skip and step.dropped else {},
        )
        events = self.detectors.observe(stats)
        warming = self.detectors.warming_changed()
        if warming is not None:  # which detectors judge by their warm-up bounds only
            stats.extra["detectors_warming"] = warming
        for e in events:
            self.outbox.event(e.to_dict())
        record = stats.to_metrics()
        chaos = self.injector.drain_log()
        if chaos:
            record["chaos"] = chaos
        self.outbox.metrics(record)
        self._recent_stats.append(stats)
        self.learning.observe(stats)
        self.cursor.advance()
        self.step_count += 1
        self.tick += 1
        self._send(force=bool(events))
        step.ended()

    def close(self) -> dict[str, Any]:
        """Flush the last report; close the in-process journal; return this rank's totals.

        Idempotent. Without a supervisor, `summary.json` is written to the run directory.
        """
        if self._closed is not None:
            return self._closed
        self._send(wait=True, ending=True)
        summary: dict[str, Any] = {
            "rank": self.rank,
            "status": "aborted" if self.stop_reason else "completed",
            "stop_reason": self.stop_reason,
            "steps_completed": self.step_count,
            "steps_executed": self.tick,
            "updates_skipped": len(self.cursor.skipped_updates),
            "final_loss": self._final_loss(),
            "skipped_batches": list(self.cursor.skipped_batches),
            "learning": self.learning.summary(),
        }
        unfired = self.injector.not_reached(self.step_count)
        if unfired:
            summary["chaos_not_reached"] = unfired  # as a Guard says it
            log.warning("chaos_fault_not_reached", rank=self.rank, faults=unfired)
        short = self._short_of_asked()
        if short is not None:
            summary["steps_asked"] = self.steps_asked
            summary["short_of_asked"] = short
            log.warning("fewer_steps_trained", rank=self.rank, detail=short)
        self._closed = summary
        ctx = self._ctx
        if ctx is not None:
            ctx.summary = summary  # what a supervised rank returns (as a Guard's close does)
        if self._owns_reporter:
            # The in-process controller's, or under a launcher the group's (rank 0 writes it).
            assert isinstance(self.reporter, LocalReporter | GroupReporter)
            self.reporter.close(summary)
        return summary

    def _short_of_asked(self) -> str | None:
        """Why fewer logical steps were trained than the framework was asked for, or None."""
        asked = self.steps_asked
        if asked is None or self.step_count >= asked or self.stop_reason:
            return None
        undone = self.tick - self.step_count
        return (
            f"trained {self.step_count} of the {asked} logical steps asked: the framework's "
            f"max_steps counts executed steps and rollbacks undid {undone}; raise max_steps "
            f"by {asked - self.step_count} to train them all"
        )

    def _final_loss(self) -> float | None:
        """The mean of the finite losses of the last 10 steps."""
        losses = [v for s in list(self._recent_stats)[-10:] if math.isfinite(v := float(s.loss))]
        return sum(losses) / len(losses) if losses else None

    def _send(self, *, force: bool = False, wait: bool = False, ending: bool = False) -> None:
        extra = {"ending": True} if ending else {}
        self.outbox.send(step=self.step_count, tick=self.tick, force=force, wait=wait, **extra)

    # ------------------------------------ what the appliers call (Guard's API)
    def take_snapshot(self) -> Snapshot:
        return Snapshot(
            step=self.step_count,
            tick=self.tick,
            cursor=self.cursor.batch,
            model=clone_to_host(self.model.state_dict()),
            optimizer=clone_to_host(self.optimizer.state_dict()),
            scheduler=clone_to_host(self.scheduler.state_dict()) if self.scheduler else None,
            scaler=self.scaler.state_dict() if self.scaler is not None else None,
            rng=capture_rng(),
            lr_scale=self.remediation.lr_scale,
            detectors=self.detectors.state_dict(),
        )

    def restore(self, snap: Snapshot, *, agree: Callable[[str | None], str] | None = None) -> None:
        """Weights, optimizer, scheduler, scaler and RNG back to `snap`; remediations stay in force.

        The step goes back with them; the loop's data position does not (`data_rewindable`).
        A callback holds no objects of the user's that could refuse their state, so there is
        nothing for the ranks to agree on (`agree` is not called).
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
        self.cursor.rewound(snap.step)
        self.snapshots.drop_after(snap.step)
        # The detectors' histories are the restored timeline's (detectors.history), never emptied.
        self.detectors.load_state_dict(snap.detectors)
        self.optimizer.zero_grad(set_to_none=True)

    def scale_lr(self, factor: float, *, min_lr: float = 0.0) -> None:
        self.remediation.lr_cut.cut(factor, min_lr=min_lr)

    @property
    def lr_scale(self) -> float:
        return self.remediation.lr_scale

    def effective_lrs(self) -> list[float]:
        return self.remediation.lr_cut.effective_lrs(self.optimizer)

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
        return self.cursor.skip_next(count)

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def module_grad_norms(self) -> dict[str, float]:
        return module_grad_norms(self.model)

    @property
    def recent_stats(self) -> deque[StepStats]:
        return self._recent_stats
