"""The Guard: instruments a training loop and applies remediations at step boundaries.

The user keeps their loop; the Guard owns what happens around each step:

    guard = Guard(model, optimizer, loss_fn=loss_fn, data=batches, scheduler=sched, max_steps=N)
    for batch in guard:
        guard.step(batch)

`guard.step` runs forward, backward and the optimizer step with one host
sync for the numbers the detectors need (loss and global gradient norm), and
skips the optimizer step at once when either is non-finite, before the
policy is even asked. Reports go to the supervisor without waiting;
commands come back on the replies and are applied by `__iter__` at the next
boundary at or after their `apply_at_tick` (after the optimizer step, before
the next forward), the same boundary on every rank.

The Guard composes named parts, each with its own tests: the step's
arithmetic (`step_executor.StepExecutor`: micro-batches, autocast, scaler,
clipping, one host read, the update), the data cursor (`data.BatchCursor`),
snapshots and checkpoints (`saver.Saver`), the command inbox
(`inbox.CommandInbox`, shared with the framework callbacks), the outbox and
heartbeat (`outbox.Outbox`) and the remediations in force
(`remediation.Remediation`); it runs the detectors, the commands and the
recovery of a lost peer around them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from remedy.control.health import final_status
from remedy.protocol.commands import Command, Outcome
from remedy.rank.actions import inprocess as actions  # noqa: F401 - registers its appliers
from remedy.rank.actions import memory as memory_actions  # noqa: F401 - registers its appliers
from remedy.rank.actions.remediation import Remediation
from remedy.rank.actions.replay import Replays, StepMark
from remedy.rank.chaos import process_faults  # noqa: F401 - memory_actions registers its appliers
from remedy.rank.chaos.faults import ChaosSetting, FaultInjector
from remedy.rank.detectors import Detector, DetectorSuite, default_detectors
from remedy.rank.exceptions import ChaosConfigError, RunAborted, UserStateError
from remedy.rank.group import replicas
from remedy.rank.group.regroup import regroup
from remedy.rank.link import end_hold, group_decide, launcher, relaunch
from remedy.rank.link.context import Reporter, WorkerContext, get_context
from remedy.rank.link.flag_hold import RESEND_S, WAIT_S, FlagHold, agree_while_holding
from remedy.rank.link.group_decide import GroupReporter
from remedy.rank.link.inbox import Agreement, CommandInbox
from remedy.rank.link.outbox import Outbox
from remedy.rank.loop import waits  # noqa: F401 - memory_actions registers its appliers
from remedy.rank.loop.learning import LearningTracker
from remedy.rank.loop.measure import (
    MemoryProbe,
    first_nonfinite_param,
    module_grad_norms,
)
from remedy.rank.loop.phases import DEFAULT_BOUND_S, SAVE, LoopPhases, overrun_event
from remedy.rank.loop.stats import StepStats
from remedy.rank.loop.step_executor import LossFn, StepExecutor, StepSettings
from remedy.rank.state import checkpoint_store, restore_point, shard_mirror, sharding
from remedy.rank.state.data import BatchCursor, DataExhausted
from remedy.rank.state.saver import Saver
from remedy.rank.state.snapshots import (
    Snapshot,
    SnapshotRing,
    capture_rng,
    clone_to_host,
    restore_rng,
)
from remedy.rank.state.user_state import UserState
from remedy.rundir.journal_effects import write_journal

if TYPE_CHECKING:
    from remedy.control.decide import Controller
    from remedy.rank.state.checkpoint_store import CheckpointStore
    from remedy.rank.state.shard_mirror import ShardMirror
    from remedy.rundir.writer import RunDir

log = structlog.get_logger("remedy.guard")

# The OOM answers a rank of a process group applies alone, mid-step: they change its memory
# use, not the numbers its replicas share (see Guard._oom_answer).
OOM_LOCAL_ACTIONS = frozenset({"enable_activation_checkpointing", "reduce_microbatch"})
# summary["final_loss"] is the mean of the finite training losses of the last this many steps.
FINAL_LOSS_STEPS = 10
# Step boundaries a Guard that may replay remembers at least (see GuardConfig.replay_window).
REPLAY_WINDOW = 8


@dataclass
class GuardConfig:
    """How often the Guard saves state and reports, and what it watches.

    Defaults suit a job of a few hundred to many thousand steps; every
    detector threshold lives on the detector objects in `detectors`.
    """

    snapshot_every: int = 10  # in-memory snapshot period, steps
    snapshot_ring: int = 12  # in-memory snapshots kept
    checkpoint_every: int = 100  # durable checkpoint period, steps (0: none)
    checkpoint_keep: int = 3
    heartbeat_s: float = 0.5  # longest quiet period between reports
    grad_clip: float | None = None
    amp_dtype: torch.dtype | None = None  # autocast dtype; None trains in full precision
    micro_batches: int = 1  # gradient-accumulation chunks per batch
    oom_retries: int = 2  # times a step that ran out of memory is retried after remediation
    oom_wait_s: float = 10.0  # how long to wait for the policy's answer to an OOM
    # Steps in a row whose update an OOM the policy could not relieve skipped: at this
    # many the run stops, aborted, with the reason (a run that cannot train must say so).
    # 0: never (the loop goes on skipping, e.g. to watch a dry-run policy).
    oom_give_up_steps: int = 3
    # Enforce a memory cap on saved activations (bytes per micro-batch forward):
    # above it the step raises a real torch.OutOfMemoryError. Exercises OOM
    # recovery where no accelerator's memory runs out; None disables.
    activation_cap_bytes: int | None = None
    # replay_step (workers.replay): the step boundaries remembered (RNG states, data
    # position), so an anomalous step among them can be re-run: the last this many
    # steps, and those of the last replay_window_s seconds (the replay command comes a
    # report's round trip after the anomaly). None: `REPLAY_WINDOW` steps in a process
    # group (whose membership takes the same RNG capture anyway) or under an in-process
    # policy that uses replay_step, else none (one capture per step, ~0.1 ms); 0: off.
    replay_window: int | None = None
    replay_window_s: float = 5.0
    # How long the ranks hold after a replay for the policy's answer to it (a restart
    # of a rank included) before they go on without one.
    replay_wait_s: float = 60.0
    # A step a detector flagged: the ranks hold at the next boundary until the
    # supervisor has decided on it (workers.flag_hold), so a replay starts there with
    # no step trained past it. None: as the supervisor says (its policy replays).
    flag_hold: bool | None = None
    flag_wait_s: float = WAIT_S  # the longest such hold
    # After the last step the ranks hold until the supervisor owes nothing on the steps
    # they trained (rank.link.end_hold), at most this long.
    end_wait_s: float = end_hold.END_WAIT_S
    # Replicas' parameters and optimizer state are compared across data-parallel
    # ranks every this many steps (workers.replicas); 0 turns the check off.
    replica_check_every: int = replicas.DEFAULT_EVERY
    kv_allocator: str = "fixed"  # allocator for KV caches made through the Guard
    detectors: list[Detector] | None = None
    # Background producers of events (e.g. the NVML sampler): objects with
    # `drain() -> list[AnomalyEvent]`, drained once per step.
    event_sources: list[Any] = field(default_factory=list)
    policy: str | None = None  # single-process mode only: policy file or bundled name
    # Phases (rank.loop.phases): how long a rank may stay in a phase of its own (an eval,
    # a save, the time between two steps) before it is `phase_overrun`; by phase name in
    # `phase_bounds` (e.g. {"eval": 1800}); `guard.phase(name, bound_s=...)` wins over both.
    phase_bound_s: float = DEFAULT_BOUND_S
    phase_bounds: dict[str, float] = field(default_factory=dict)


@dataclass
class StepResult:
    """What `guard.step(batch)` returns: the step's numbers as the detectors saw them."""

    step: int  # the logical step just trained (goes back after a rollback)
    loss: float  # the batch's loss (nan when the step ran out of memory)
    grad_norm: float  # global gradient norm, before clipping
    lr: float  # the first param group's LR as applied: the schedule's times any shrink_lr cut
    optimizer_skipped: bool  # True when the weights were not updated (non-finite, overflow, OOM)
    events: list[str] = field(default_factory=list)  # kinds of the anomalies this step raised


class Guard:
    """Wraps model, optimizer, scheduler, scaler and data for one rank."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: LossFn,
        data: Any,
        max_steps: int | None = None,
        epochs: int | None = None,
        scheduler: Any | None = None,
        scaler: torch.amp.GradScaler | None = None,
        config: GuardConfig | None = None,
        context: WorkerContext | None = None,
        run_dir: str | Path | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        # The loop's own Stateful objects (rank.state.user_state), checked before anything starts.
        self.user_state = UserState(state)
        self.max_steps = max_steps
        self.config = config or GuardConfig()
        # Where this rank is outside training on purpose (rank.loop.phases).
        self.phases = LoopPhases(self.config.phase_bound_s, self.config.phase_bounds)
        ctx = context or get_context()
        self._owns_controller = ctx is None or ctx.reporter is None
        if ctx is None:
            ctx = WorkerContext(run_dir=Path(run_dir) if run_dir else None)
        elif ctx.launcher is not None and ctx.run_dir is None and run_dir:
            ctx.run_dir = Path(run_dir)  # another launcher's rank writes where the loop says
            relaunch.note_start(ctx)  # Ray Train says nothing of restarts: the run directory does
        self.ctx = ctx
        self.rank = ctx.rank
        self.run_dir = ctx.run_dir
        self.reporter: Reporter = ctx.reporter or self._local_reporter(ctx)
        self.injector = FaultInjector(
            ctx.faults,
            ctx.rank,
            run_dir=ctx.run_dir,
            kill_supervisor=getattr(self.reporter, "kill_supervisor", None),
            kill_node=getattr(self.reporter, "kill_node", None),
        )
        self.injector.attach(model)
        # What actions changed in how this rank trains (LR cuts, micro-batch split, KV allocator).
        self.remediation = Remediation(
            micro_batches=self.config.micro_batches, kv_allocator=self.config.kv_allocator
        )
        # The step's arithmetic (workers.step_executor): it owns the model, optimizer,
        # scheduler and scaler; a sharded model's scaler is the sharded one.
        self.executor = StepExecutor(
            model,
            optimizer,
            loss_fn=loss_fn,
            scheduler=scheduler,
            scaler=scaler,
            settings=StepSettings(
                amp_dtype=self.config.amp_dtype,
                activation_cap_bytes=self.config.activation_cap_bytes,
                grad_clip=self.config.grad_clip,
            ),
            remediation=self.remediation,
            injector=self.injector,
        )
        self.cursor = BatchCursor(data, epochs=epochs)
        self.data_exhausted: str | None = None  # why the data ended the loop, if it did
        self._epoch = 0  # the epoch the detectors were last told of
        detectors = self.config.detectors
        self.detectors = DetectorSuite(default_detectors(model) if detectors is None else detectors)
        # Detectors that need the model: weights to watch, a DDP model's all-reduces to time.
        for detector in self.detectors.detectors:
            attach = getattr(detector, "attach", None)
            if callable(attach) and getattr(detector, "model", None) is None:
                attach(model)
        # Detectors that look at the batch itself (padding, duplicates) before the step.
        self._batch_inspectors: list[Any] = [
            d for d in self.detectors.detectors if callable(getattr(d, "inspect_batch", None))
        ]
        # Snapshots (the ring a rollback restores) and durable checkpoints (workers.saver).
        self.saver = Saver(
            self.config.snapshot_ring,
            # A sharded model in a process group checkpoints through DCP (workers.dcp_store).
            checkpoint_store.store_for(
                self, self.run_dir / "checkpoints", keep=self.config.checkpoint_keep
            )
            if self.run_dir is not None and self.config.checkpoint_every > 0
            else None,
            # A sharded rank's newest snapshot is mirrored to its buddy rank (workers.shard_mirror).
            shard_mirror.mirror_for(self),
            rank=self.rank,
        )
        if ctx.launcher is not None and self.checkpoints is not None:
            # The launcher started the group again (torchrun's restart, Ray Train's FailureConfig).
            ctx.resume_step = launcher.resume_step(self.run_dir, ctx.attempt)
        # A rank started by a full-group restart resumes from this checkpoint before its first step.
        self._resume_step = ctx.resume_step
        self.resumed: dict[str, Any] | None = None
        self._memory = MemoryProbe(self.device)
        # A fault that cannot fire here is an error before the first step, never a no-op.
        self.injector.check(
            ChaosSetting(
                world_size=ctx.world_size,
                supervised=getattr(self.reporter, "kill_supervisor", None) is not None,
                checkpoint_every=self.config.checkpoint_every if self.checkpoints else 0,
                scaler=self.executor.scaled,
            )
        )
        self.step_count = 0
        self.tick = 0
        self.recent_stats: deque[StepStats] = deque(maxlen=50)
        self.learning = LearningTracker()  # the summary's `learning`: a run that stopped learning
        self.inbox = CommandInbox()  # the supervisor's commands, each applied once
        # With a process group of several ranks, commands are applied by agreement (see _boundary).
        self._group: Any = None
        self._group_device = torch.device("cpu")
        self.agreement: Agreement | None = None
        # A flagged step waits for its decision (workers.flag_hold); switched on below.
        self.flag_hold = FlagHold(wait_s=self.config.flag_wait_s)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":
                self._group_device = torch.device("cuda", torch.cuda.current_device())
            self.use_group(dist.group.WORLD)
            if (
                ctx.launcher is not None
            ):  # no supervisor: the group decides once (link/group_decide)
                group_decide.join(self)
        # Step marks and pre-step states for replay_step; the boundary the current step began at.
        self.replays = Replays(self._replay_window(), self.config.replay_window_s)
        self.step_mark: StepMark | None = None
        hold = self.config.flag_hold
        asked = ctx.hold_on_flag if hold is None else hold
        self.flag_hold.on = bool(asked) and self.replays.window > 0
        # Data-parallel replicas compared every so many steps (workers.replicas).
        self.replica_check = replicas.ReplicaCheck(self.config.replica_check_every)
        # Reports out: events, metrics (built from (stats, chaos log) when a report leaves).
        self.outbox = Outbox(
            self.reporter,
            self.inbox,
            rank=self.rank,
            heartbeat_s=self.config.heartbeat_s,
            build=lambda item: _metrics_record(*item),
        )
        self._stop_reason: str | None = None
        self._loader_time = 0.0
        self._closed = False
        self._oom_skips = 0  # steps in a row an unrelieved OOM skipped
        # Whether each logical step's update was skipped, as last trained (for goodput).
        self._update_skipped: dict[int, bool] = {}
        self.summary: dict[str, Any] = {}
        # Several ranks under a supervisor: a lost peer is survived, not raised (workers.membership).
        self.membership = ctx.membership
        if self.membership is not None:
            self.membership.attach(self)

    def _replay_window(self) -> int:
        """The step marks to keep (`GuardConfig.replay_window`; None decides here)."""
        if self.config.replay_window is not None:
            return self.config.replay_window
        if self._group is not None:
            return REPLAY_WINDOW
        controller = getattr(self.reporter, "controller", None)
        policy = controller.engine.policy if controller is not None else None
        return REPLAY_WINDOW if policy is not None and policy.uses("replay_step") else 0

    # ------------------------------------------------------------- local mode
    def _local_reporter(self, ctx: WorkerContext) -> Reporter:
        from remedy.control.decide import Controller  # noqa: PLC0415
        from remedy.policies import Engine, load_policy  # noqa: PLC0415 - single-process mode only
        from remedy.rank.loop.metrics import standalone_metrics  # noqa: PLC0415
        from remedy.rundir.writer import RunDir  # noqa: PLC0415

        engine = Engine(load_policy(self.config.policy or "default"), run_id=ctx.run_id)
        run_dir = RunDir(ctx.run_dir, ctx.run_id) if ctx.run_dir is not None else None
        if ctx.launcher is not None:  # a rank of another launcher's group: rank 0 decides
            return group_decide.reporter_for(ctx, engine, run_dir)
        metrics = standalone_metrics(ctx.run_id, run_dir.checkpoints if run_dir else None)
        return LocalReporter(
            Controller(engine, world_size=1, journal=run_dir is not None),
            run_dir=run_dir,
            metrics=metrics,
        )

    # ------------------------------------------------------------------ loop
    def __iter__(self) -> Iterator[Any]:
        try:
            while True:
                self._boundary()
                self.injector.at_boundary(self.step_count, self.checkpoints)
                if self._at_last_step() and self._stop_reason is None and self._hold_at_end():
                    continue  # a command sent the loop back (a rollback), or the group re-formed
                if self._stop_reason is not None or self._at_last_step():
                    break
                t0 = time.perf_counter()
                mark = self.step_mark = (
                    self.replays.mark(self)
                    if self.replays.window or self.membership is not None
                    else None
                )
                if self.membership is not None:
                    self.membership.mark(self)
                self.injector.before_batch(self.step_count)
                try:
                    self.executor.batch_index, batch = self.cursor.next()
                except DataExhausted as end:  # the normal end of a loop that runs out of data
                    self.data_exhausted = str(end)
                    log.info("data_exhausted", detail=str(end), step=self.step_count)
                    break
                if mark is not None:
                    self.replays.fetched(
                        mark, self.executor.batch_index, batch, rewindable=self.cursor.rewindable
                    )
                self._loader_time = time.perf_counter() - t0
                if self.cursor.epoch != self._epoch:
                    self._epoch = self.cursor.epoch
                    self.detectors.new_epoch(self._epoch)
                for inspector in self._batch_inspectors:
                    inspector.inspect_batch(batch)
                yield batch
        finally:
            self.close()

    def _boundary(self) -> None:
        """The safe point between steps: take commands, apply due ones, snapshot."""
        self._rejoined()  # a replacement's first boundary: it adopts the group's state
        if self._resume_step is not None:
            step, self._resume_step = self._resume_step, None
            self.resumed = restore_point.resume(self, step)
            self._report_corrupt()
        self.inbox.take(self.reporter.poll())
        self._report_checkpoint_events("checkpoint_write_failed", self.saver.write_failures())
        if self.agreement is not None:
            # Every rank applies the same commands at the same boundary, or their step
            # counts and collectives would part ways: those every rank held at the last one.
            try:
                agreed = self.agreement.agreed(self.inbox.max_seq)
                if self.agreement.news:  # a rank has news for the group's decider: exchange
                    assert isinstance(self.reporter, GroupReporter)
                    self.inbox.take(self.reporter.exchange())
            except RuntimeError as exc:
                if not self._rejoined(exc):
                    raise
                self._boundary()  # agree again, in the new generation
                return
            due = self.inbox.due_up_to_seq(agreed) if agreed is not None else []
        else:
            due = self.inbox.due_at_tick(self.tick)
        self.inbox.apply(due, self)
        if due:
            self._report_corrupt()
            self._send(force=True)
        if self.flag_hold.on and self._hold_for_decision():
            self._boundary()  # the group re-formed while holding: agree again in the new one
            return
        if self.replays.hold is not None and self._await_answer():
            self._boundary()  # the group re-formed while waiting: agree again in the new one
            return
        if self._group is not None and self.replica_check.due(self.step_count):
            try:
                diverged = self.replica_check.check(self)
            except RuntimeError as exc:
                if not self._rejoined(exc):
                    raise
                self._boundary()
                return
            if diverged is not None:
                self.report_event(diverged)
        # A durable checkpoint is written from a snapshot: one is taken at its boundary too.
        due_snapshot = self.step_count % self.config.snapshot_every == 0 or self._checkpoint_due()
        if due_snapshot and (
            not len(self.snapshots) or self.snapshots.steps()[-1] != self.step_count
        ):
            self._snapshot()

    def _at_last_step(self) -> bool:
        return self.max_steps is not None and self.step_count >= self.max_steps

    def _hold_at_end(self) -> bool:
        """After the last step: hold until the supervisor owes nothing on the steps trained
        (`rank.link.end_hold`). True when the loop goes on (a command sent it back, or the
        group re-formed and agrees again)."""
        settled = getattr(self.reporter, "settled", None)
        if settled is None or self.tick == 0:
            return False
        last = self.tick - 1
        end, _, _ = self._hold_here(
            wait_s=self.config.end_wait_s,
            holding=last,
            final=True,
            ready=lambda: end_hold.released(self, settled(), last),
        )
        if end == "late":
            log.warning("end_decision_missing", tick=last, waited_s=self.config.end_wait_s)
        return end == "regrouped" or not self._at_last_step()

    def _hold_for_decision(self) -> bool:
        """A step just run was flagged (on any rank): hold here until the supervisor has decided
        on it (`workers.flag_hold`). True when the group re-formed meanwhile."""
        if self.agreement is not None:
            try:
                tick = self.agreement.flagged()
            except RuntimeError as exc:
                if not self._rejoined(exc):
                    raise
                return True
        else:
            tick = self.flag_hold.take()
        if not self.flag_hold.due(tick, self.step_count):
            if tick is not None and self.flag_hold.on:
                self.flag_hold.note(tick, self.step_count, "quiet")
            return False
        assert tick is not None
        reporter_settled = getattr(self.reporter, "settled", None)
        held_at = time.monotonic()
        end, first, last = self._hold_here(
            wait_s=self.flag_hold.wait_s,
            holding=tick,
            ready=lambda: reporter_settled is None or reporter_settled() >= tick,
        )
        if end == "late":
            log.warning("flag_decision_missing", tick=tick, waited_s=self.flag_hold.wait_s)
        brought = last != first
        self.flag_hold.note(
            tick, self.step_count, end, held_s=time.monotonic() - held_at, brought=brought
        )
        self.flag_hold.after(self.step_count, brought=brought)
        return end == "regrouped"

    def _await_answer(self) -> bool:
        """After a replay: hold at this boundary until the policy's answer to it is in.

        The answer comes as the replay's `-answer` command, after the commands it
        decided (a rollback, say), and is applied with them; an answer that restarts a
        rank keeps the ranks here until it is replaced (the survivors' collective here
        fails when it is killed, and they re-form the group). Ranks give up together
        after `replay_wait_s`. True when the group re-formed meanwhile.
        """
        hold = self.replays.hold
        end, _, _ = self._hold_here(
            wait_s=self.config.replay_wait_s, ready=lambda: self.replays.hold is None
        )
        if end == "late" and self.replays.hold is not None:
            log.warning("replay_answer_missing", waited_s=self.config.replay_wait_s,
                        decision=hold.decision_id if hold else None)  # fmt: skip
        if end != "ready":  # late, or the group re-formed (the restart it waited for)
            self.replays.hold = None
        return end == "regrouped"

    def _hold_here(
        self,
        *,
        wait_s: float,
        ready: Callable[[], bool],
        holding: int | None = None,
        final: bool = False,
    ) -> tuple[str, int, int]:
        """Wait at this boundary, reporting and taking replies and applying the commands every
        rank holds, until `ready()` on every rank, or one rank has waited `wait_s`.

        Returns how it ended ("ready", "late", or "regrouped": a peer was lost and the
        group re-formed) and the command seq agreed in the first and the last round (the
        same on every rank: whether the wait brought commands).
        """
        deadline = time.monotonic() + wait_s
        next_report = 0.0
        first: int | None = None
        seq = self.inbox.max_seq
        while True:
            now = time.monotonic()
            if now >= next_report:  # reports that fetch replies (a replay's outcome first)
                self._send(force=True, holding=holding, final=final)
                next_report = now + RESEND_S
            self.inbox.take(self.reporter.poll())
            late, done = now > deadline, ready()
            if self._group is not None:
                try:
                    seq, late, done = agree_while_holding(
                        self._group, self._group_device, self.inbox.max_seq, late=late, ready=done
                    )
                    if isinstance(self.reporter, GroupReporter):  # the answer comes by exchange
                        self.inbox.take(self.reporter.exchange())
                except RuntimeError as exc:
                    if not self._rejoined(exc):
                        raise
                    return "regrouped", first or seq, seq
            else:  # alone: whatever came is the answer, whatever tick it was meant for
                seq = self.inbox.max_seq
            first = seq if first is None else first
            due = self.inbox.due_up_to_seq(seq)
            if due:
                self.inbox.apply(due, self)
                self._send(force=True)
            if done or late:
                return ("ready" if done else "late"), first, seq
            time.sleep(0.005)

    def _snapshot(self) -> None:
        """Snapshot this boundary, and checkpoint it when one is due (`workers.saver`)."""
        due = self._checkpoint_due()
        with self.phases.clock.phase(SAVE):
            self._save(due)

    def _save(self, due: bool) -> None:
        self.saver.save(
            self.step_count,
            lambda into: self.take_snapshot(into=into),
            extra=self.checkpoint_extra if due else None,
            # Chaos: this write meets a file-size limit of 0 (EFBIG on every retry).
            write_fault=due and self.injector.checkpoint_write_fault(self.step_count) is not None,
        )

    def _checkpoint_due(self) -> bool:
        every = self.config.checkpoint_every
        return self.checkpoints is not None and every > 0 and self.step_count % every == 0

    def checkpoint_extra(self) -> dict[str, Any]:
        """What a checkpoint holds besides the snapshot: the remediations and command bookkeeping,
        so a fresh process resuming from it continues as the run did (`restore_point.resume`)."""
        return restore_point.remediations(self)

    def _report_corrupt(self) -> None:
        """Checksum failures met while restoring become `checkpoint_corrupt` events."""
        self._report_checkpoint_events("checkpoint_corrupt", self.saver.corrupt())

    def _report_checkpoint_events(self, kind: str, found: list[tuple[int, str]]) -> None:
        """One `kind` event per (checkpoint step, error), sent at once."""
        from remedy.policies import AnomalyEvent  # noqa: PLC0415

        for checkpoint_step, error in found:
            ev = AnomalyEvent(
                kind=kind,
                rank=self.rank,
                step=self.step_count,
                tick=self.tick,
                severity="warning",
                ts=time.time(),
                details={"checkpoint_step": checkpoint_step, "error": error[:300]},
            )
            self.outbox.event(ev.to_dict())
        if found:
            self._send(force=True)

    def step(self, batch: Any) -> StepResult:
        """One training step on `batch`: forward, backward, checks, optimizer step, report."""
        t0 = time.perf_counter()
        step = self.step_count
        late_ms, warming = self.phases.begin()  # the phase before this step
        if self.agreement is not None:
            # The step's one all-reduce, read in its one sync: the commands every rank holds,
            # whether a rank has news (group_decide), and the phase each rank told.
            self.agreement.launch(self.inbox.max_seq, news=getattr(self.reporter, "has_news", False),
                                  late_ms=late_ms, warming=warming)  # fmt: skip
        # Gradients are freed here rather than after the optimizer step: freed at the
        # end, the allocator hands the memory back to the OS and the next backward
        # page-faults it in again (1-2.5% of a 50M-parameter CPU step).
        self.optimizer.zero_grad(set_to_none=True)
        ooms: list[str] = []  # an OOM relieved on retry is still one of the step's events
        self.injector.tick(self.tick)
        storms = self.injector.storm_steps
        for attempt in range(self.config.oom_retries + 1):
            try:
                self.injector.before_step(step)
                loss = self.forward_backward(batch)
                self._oom_skips = 0
                break
            except torch.OutOfMemoryError as exc:
                self.optimizer.zero_grad(set_to_none=True)
                if self.sharded:  # FSDP's half-done iteration: else it never reduces again
                    sharding.reset_iteration(self.model)
                self._report_oom(step, str(exc), attempt)
                ooms.append("oom")
                if attempt == self.config.oom_retries or not self._await_commands():
                    self._give_up_after_oom(str(exc))
                    return self._finish_step(
                        t0, math.nan, math.nan, skipped=True, oom=True, also=ooms[:1]
                    )
            except RuntimeError as exc:
                # A peer was lost inside a collective: the step is discarded, not raised.
                if not self._rejoined(exc, in_step=True):
                    raise
                lr = float(self.optimizer.param_groups[0]["lr"])
                return StepResult(step, math.nan, math.nan, lr, optimizer_skipped=True)
        try:
            norm_t = self.finish_grads()
        except RuntimeError as exc:  # a sharded norm's all-reduce: a peer was lost
            if not self._rejoined(exc, in_step=True):
                raise
            lr = float(self.optimizer.param_groups[0]["lr"])
            return StepResult(step, math.nan, math.nan, lr, optimizer_skipped=True)
        try:
            agreed_t = self.agreement.for_sync() if self.agreement is not None else None
        except RuntimeError as exc:  # the agreement's all-reduce: a peer was lost
            if not self._rejoined(exc, in_step=True):
                raise
            lr = float(self.optimizer.param_groups[0]["lr"])
            return StepResult(step, math.nan, math.nan, lr, optimizer_skipped=True)
        # One host sync for the loss, the norm and the agreement (commands, news, phases).
        loss_v, norm_v, (agreed_v,) = self.executor.read_all(loss, norm_t, [agreed_t])
        phase_v = None
        if agreed_v is not None and self.agreement is not None:
            self.agreement.settle(agreed_v)
            phase_v = self.agreement.phase
        extra: dict[str, Any] = {}
        self.phases.note(phase_v, extra)
        if not math.isfinite(norm_v):
            extra["nonfinite_param"] = (
                sharding.first_nonfinite_param if self.sharded else first_nonfinite_param
            )(self.model)
        if self.replays.window:
            self._keep_if_flagged(loss_v, norm_v)
        if self.flag_hold.on and self.agreement is not None:
            self.agreement.launch_flag(self.flag_hold.take())  # beside the optimizer step
        skipped = self.executor.optimizer_step(loss_v, norm_v)
        if self.injector.storm_steps > storms and not skipped:
            raise ChaosConfigError(
                f"chaos: scaler_overflow_storm at step {step} did not overflow: this backward "
                "does not run in float16 (GuardConfig(amp_dtype=torch.float16) runs it so)"
            )
        self.injector.after_update(step)
        return self._finish_step(t0, loss_v, norm_v, skipped=skipped, extra=extra, also=ooms[:1])

    def finish_grads(self) -> torch.Tensor:
        """After backward: chaos's gradient faults, unscaling, the global norm, clipping
        (`StepExecutor.finish_grads`); the norm before clipping, on the device."""
        return self.executor.finish_grads(self.step_count)

    def _keep_if_flagged(self, loss_v: float, norm_v: float) -> None:
        """A step a detector will report keeps the state from before its update (replay_step)."""
        scaled = self.executor.scaled
        if self.detectors.flags(loss_v, norm_v, scaled=scaled):
            by_loss = self.detectors.flags(loss_v, 0.0, scaled=scaled)
            self.replays.keep(self, loss_v, flagged="loss" if by_loss else "grads")
            self.flag_hold.flag(self.tick)

    def _give_up_after_oom(self, message: str) -> None:
        """An OOM the policy did not relieve skipped this step: stop once too many in a row have."""
        self._oom_skips += 1
        limit = self.config.oom_give_up_steps
        if limit > 0 and self._oom_skips >= limit and self._stop_reason is None:
            self.request_stop(
                f"{self._oom_skips} steps in a row ran out of memory and were skipped: the "
                f"policy's remedies did not relieve it ({message[:120]})"
            )

    def set_batch_index(self, index: int) -> None:
        """The index of the batch the next forward trains on (a replay's earlier batch)."""
        self.executor.batch_index = index

    def forward_backward(self, batch: Any, *, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Forward and backward over `batch`'s micro-batches (`StepExecutor.forward_backward`)."""
        return self.executor.forward_backward(batch, self.step_count, model=model)

    # The user's objects, as the executor holds them (a sharded model's scaler is the sharded one).
    @property
    def model(self) -> torch.nn.Module:
        return self.executor.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.executor.optimizer

    @property
    def scheduler(self) -> Any | None:
        return self.executor.scheduler

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.executor.scaler

    @property
    def loss_fn(self) -> LossFn:
        return self.executor.loss_fn

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.executor.params

    @property
    def device(self) -> torch.device:
        return self.executor.device

    @property
    def sharded(self) -> bool:
        return self.executor.sharded

    def _finish_step(
        self,
        t0: float,
        loss_v: float,
        norm_v: float,
        *,
        skipped: bool,
        oom: bool = False,
        extra: dict[str, Any] | None = None,
        also: list[str] | None = None,
    ) -> StepResult:
        if self.flag_hold.on and self.agreement is not None and not self.agreement.flag_launched:
            self.agreement.launch_flag(None)  # a step that ended early: every rank launches one
        allocated, reserved, capacity = self._memory.read()
        stats = StepStats(
            step=self.step_count,
            tick=self.tick,
            rank=self.rank,
            loss=loss_v,
            grad_norm=norm_v,
            lr=self.remediation.lr_cut.effective(float(self.optimizer.param_groups[0]["lr"])),
            step_time_s=time.perf_counter() - t0,
            loader_time_s=self._loader_time,
            batch_index=self.executor.batch_index,
            loss_scale=float(self.scaler.get_scale())
            if self.scaler is not None and self.executor.scaled
            else None,
            scaler_skipped=skipped and self.scaler is not None and math.isfinite(loss_v),
            mem_bytes=allocated,
            mem_reserved_bytes=reserved,
            mem_capacity_bytes=capacity,
            optimizer_skipped=skipped,
            grad_clip=self.config.grad_clip,
            extra=extra or {},
        )
        events = [] if oom else self.detectors.observe(stats)
        events += [overrun_event(stats, o) for o in self.phases.end()]
        warming = None if oom else self.detectors.warming_changed()
        if warming is not None:  # which detectors judge by their warm-up bounds only
            stats.extra["detectors_warming"] = warming
        for source in self.config.event_sources:
            events.extend(
                dataclasses.replace(e, rank=stats.rank, step=stats.step, tick=stats.tick)
                for e in source.drain()
            )
        self.recent_stats.append(stats)
        self.learning.observe(stats)
        # Records are built when a report goes out, a batch at a time.
        self.outbox.metrics((stats, self.injector.drain_log()))
        for e in events:
            self.outbox.event(e.to_dict())
        self._update_skipped[self.step_count] = skipped
        self.step_count += 1
        self.tick += 1
        self._send(force=bool(events))
        kinds = [*(also or []), *(e.kind for e in events)]
        return StepResult(stats.step, loss_v, norm_v, stats.lr, skipped, kinds)

    # ------------------------------------------------------------- OOM path
    def _report_oom(self, step: int, message: str, attempt: int) -> None:
        from remedy.policies import AnomalyEvent  # noqa: PLC0415

        ev = AnomalyEvent(
            kind="oom",
            rank=self.rank,
            step=step,
            tick=self.tick,
            severity="critical",
            ts=time.time(),
            details={
                "message": message[:300],
                "attempt": attempt,
                "micro_batches": self.remediation.micro_batches,
            },
        )
        self.outbox.event(ev.to_dict())
        self._send(force=True)

    def _await_commands(self) -> bool:
        """After an OOM: take the policy's answer and apply it now; True if anything was applied.

        The supervisor decides while it ingests a report, and its reply carries the
        commands: once the replies to the OOM report are in, nothing more is coming
        (a dry run, a cooling-down rule, no rule), so the step gives up at once
        instead of waiting for commands that never come.
        """
        deadline = time.monotonic() + self.config.oom_wait_s
        self._send(force=True, wait=True)
        while True:
            self.inbox.take(self.reporter.poll())
            now = self._oom_answer()
            if now:
                self.inbox.apply(now, self)
                self._send(force=True)
                return True
            # A reporter whose replies may come before the decision (none does so far)
            # sets `answers_later`; only then is it worth waiting, up to oom_wait_s.
            if not getattr(self.reporter, "answers_later", False) or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
            self._send(force=True)

    def _oom_answer(self) -> list[Command]:
        """The queued commands this rank applies now, in the middle of its OOM'd step.

        Alone, every one. In a process group the replicas must change at one agreed
        boundary, so only the OOM's own answer that changes nothing the replicas share
        (its memory relief) is applied by this rank now; the rest (a rollback decided
        for an earlier step, say) waits for that boundary, as on every other rank.
        """
        queued = self.inbox.all_queued()
        if self._group is None:
            return queued
        return [
            c for c in queued if c.anomaly_step == self.step_count and c.action in OOM_LOCAL_ACTIONS
        ]

    # ------------------------------------------------------------- reporting
    def send_report(self, *, collective_failed: bool = False) -> None:
        """Report now, news or not (a rank that has just joined says so at once).

        `collective_failed`: this rank's collective has just failed (a peer's process
        or node is gone, most often), which the report says: the supervisor then pings
        every rank at once instead of waiting for the lost one's silence to time out.
        """
        self._send(force=True, collective_failed=collective_failed)

    def _rejoined(self, failed: BaseException | None = None, *, in_step: bool = False) -> bool:
        """Whether this rank has just entered a new generation of its group: the one place the
        Guard regroups (`rank.group.regroup`, which says the order). `failed`: a collective's
        error (None: at a boundary, where a replacement adopts the group's state); `in_step`:
        raised inside a step, which is discarded. False: nothing to enter, or `failed` is not a
        lost peer, which the caller raises."""
        return regroup(self, failed, in_step=in_step)

    def use_group(self, group: Any) -> None:
        """Agree on commands through `group` from now on (a new generation's process group);
        an agreement launched in the old one is dropped."""
        self._group = group
        self.agreement = Agreement(group, self._group_device)
        self.phases.use_group()
        # Whether to hold is decided alike on every rank: a replacement joins with no
        # quiet period, so every rank of the new group starts without one.
        self.flag_hold.quiet_until = 0

    def _send(
        self,
        *,
        force: bool = False,
        wait: bool = False,
        ending: bool = False,
        holding: int | None = None,
        final: bool = False,
        collective_failed: bool = False,
    ) -> None:
        # `ending`: the loop is done, this rank takes no more steps (the hang watch stops
        # expecting progress from it). `holding`: the tick of a flagged step this rank
        # holds for (workers.flag_hold): the reply says when it is settled.
        extra: dict[str, Any] = {"ending": True} if ending else {}
        if holding is not None:
            extra["holding"] = holding
            if final:  # at the last step: settled once nothing is owed (rank.link.end_hold)
                extra["final"] = True
        if collective_failed:
            extra["collective_failed"] = True
        self.outbox.send(
            step=self.step_count,
            tick=self.tick,
            force=force,
            wait=wait,
            **extra,
            # For progress displays: the step total and the batch size last seen.
            max_steps=self.max_steps,
            batch_size=self.remediation.max_micro_batches,
        )

    # ------------------------------------------------------- state handling
    @property
    def next_step(self) -> int:
        """The logical step the batch in hand will train (read it before `step(batch)`).

        Right in every case: a fresh run, after a rollback (the restored step), in a
        replacement rank (the step the group stopped at), after a resume from a durable
        checkpoint. Derive loop counters and hand-set schedules from it
        (`lr = get_lr(guard.next_step)`), never from a counter of the loop's own.
        """
        return self.step_count

    def phase(self, name: str, *, bound_s: float | None = None) -> AbstractContextManager[None]:
        """`with guard.phase("eval"):` marks the code inside as this rank's own phase (an eval,
        a save, a log: `rank.loop.phases`): the peers waiting for it are not slow, it is not
        hung within `bound_s` (default `GuardConfig.phase_bound_s`), past it `phase_overrun`."""
        return self.phases.clock.phase(name, bound_s=bound_s)

    def register_state(self, name: str, obj: Any, *, per_rank: bool = False) -> None:
        """Keep `obj` (with `state_dict()`/`load_state_dict()`) through every recovery, as `state=`
        does; `per_rank`: each rank's own, never taken from a peer (`rank.state.user_state`)."""
        self.user_state.register(name, obj, per_rank=per_rank)

    def take_snapshot(self, into: Snapshot | None = None) -> Snapshot:
        """Host copy of everything a rollback restores; `into`'s buffers are reused if given."""
        return Snapshot(
            step=self.step_count,
            tick=self.tick,
            cursor=self.cursor.position,
            model=clone_to_host(self.model.state_dict(), into.model if into else None),
            optimizer=clone_to_host(self.optimizer.state_dict(), into.optimizer if into else None),
            scheduler=clone_to_host(self.scheduler.state_dict())
            if self.scheduler is not None
            else None,
            scaler=self.scaler.state_dict() if self.scaler is not None else None,
            rng=capture_rng(),
            lr_scale=self.remediation.lr_scale,
            user=self.user_state.capture(),
            data=self.cursor.source_state(),
            detectors=self.detectors.state_dict(),
        )

    def restore(
        self, snap: Snapshot, *, own: bool = True, agree: Callable[[str | None], str] | None = None
    ) -> None:
        """Put the loop back at the boundary before `snap.step`, keeping remediations in force.

        `own`: `snap` is this rank's (a rollback, a resume); else a peer's (an adopted
        state), whose per-rank user state and data source state are not loaded.
        `agree`: called by every rank of the group together once the user's objects are
        loaded, with this rank's failure (None when they loaded); it returns why another
        rank failed ("" when none did). Where one did, this rank puts its objects back and
        raises too, so no rank restores alone and the replicas stay equal.
        """
        # The user's objects first: a load_state_dict that raises leaves everything as it was.
        names = None if own else self.user_state.names(per_rank=False)
        before = self.user_state.capture() if agree is not None and len(self.user_state) else None
        failure: UserStateError | None = None
        try:
            self.user_state.load(snap.user, names=names)
        except UserStateError as exc:
            failure = exc
        if agree is not None:
            elsewhere = agree(None if failure is None else str(failure))
            if elsewhere and failure is None:
                if before is not None:
                    self.user_state.load(before, names=names)
                raise UserStateError(f"{elsewhere}; no rank restored anything")
        if failure is not None:
            raise failure
        # A sharded model's snapshot holds local shards: rebuilt as DTensors, each rank loads its own.
        self.model.load_state_dict(sharding.rebuild(snap.model))
        # Loading may alias the given tensors; the snapshot must stay pristine for a second rollback.
        self.optimizer.load_state_dict(sharding.rebuild(clone_to_host(snap.optimizer), copy=True))
        if self.scheduler is not None and snap.scheduler is not None:
            self.scheduler.load_state_dict(clone_to_host(snap.scheduler))
        if self.scaler is not None and snap.scaler is not None:
            self.scaler.load_state_dict(snap.scaler)
        restore_rng(snap.rng)
        self.step_count = snap.step
        self.cursor.seek(snap.cursor)
        if own:
            self.cursor.restore_source(snap.data)
        # The param groups hold the scheduled LR, never the cut (see lr_scale.py), so an LR
        # cut decided after the snapshot stays in force: it is a remediation, not training state.
        self.snapshots.drop_after(snap.step)
        self.replays.forget_after(snap.step)
        # The detectors' histories are the restored timeline's (detectors.history), never emptied.
        self.detectors.load_state_dict(snap.detectors)
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def snapshots(self) -> SnapshotRing:
        """The in-memory ring of snapshots a rollback restores (`saver`)."""
        return self.saver.snapshots

    @property
    def checkpoints(self) -> CheckpointStore | None:
        """The durable checkpoint store, or None without a run directory or checkpoints."""
        return self.saver.checkpoints

    @property
    def mirror(self) -> ShardMirror | None:
        """A sharded rank's snapshot mirror to its buddy, or None."""
        return self.saver.mirror

    def scale_lr(self, factor: float, *, min_lr: float = 0.0) -> None:
        """Cut every LR by `factor` (not below `min_lr`) from now on, whatever the schedule does."""
        self.remediation.lr_cut.cut(factor, min_lr=min_lr)

    @property
    def lr_scale(self) -> float:
        return self.remediation.lr_scale

    @property
    def micro_batches(self) -> int:
        """Micro-batches each batch is split into (`reduce_microbatch` raises it)."""
        return self.remediation.micro_batches

    @property
    def kv_allocator(self) -> str:
        """The allocator for KV caches made now (`switch_kv_allocator` changes it)."""
        return self.remediation.kv_allocator

    def effective_lrs(self) -> list[float]:
        """The LR of each param group as the optimizer applies it (schedule times the cuts)."""
        return self.remediation.lr_cut.effective_lrs(self.optimizer)

    def report_event(self, event: Any) -> None:
        """Send an anomaly the user's code found (e.g. a KV-cache measure) with the next report."""
        if event is not None:
            self.outbox.event(event.to_dict())
            self._send(force=True)

    def track_kv_cache(self, cache: Any) -> None:
        """Register a live KV cache so `switch_kv_allocator` migrates it."""
        self.remediation.kv_caches.add(cache)

    def submit(self, command: Command) -> None:
        """Queue a command by hand (an operator's intervention, a test); applied like any other."""
        self.inbox.submit(command)

    @property
    def history(self) -> deque[Outcome]:
        """Every applied or failed command, newest last."""
        return self.inbox.history

    @property
    def group(self) -> Any:
        """The process group the ranks agree through (None for one rank)."""
        return self._group

    @property
    def data_rewindable(self) -> bool:
        return self.cursor.rewindable or self.cursor.restorable

    def refusal(self, action: str) -> str | None:
        """Every in-process action applies to a Guard's loop."""
        del action
        return None

    def skip_next(self, count: int) -> list[int]:
        return self.cursor.skip_next(count)

    def module_grad_norms(self) -> dict[str, float]:
        return (sharding.module_grad_norms if self.sharded else module_grad_norms)(self.model)

    def request_stop(self, reason: str) -> None:
        self._stop_reason = reason

    @property
    def stopped(self) -> str | None:
        return self._stop_reason

    # ----------------------------------------------------------------- end
    def close(self) -> dict[str, Any]:
        """Flush reports and checkpoints; return this rank's summary. Idempotent."""
        if self._closed:
            return self.summary
        self._closed = True
        if self.agreement is not None:
            self.agreement.finish()
        self._send(wait=True, ending=True)
        self.saver.close()
        self.phases.close()
        recent = list(self.recent_stats)[-FINAL_LOSS_STEPS:]
        losses = [s.loss for s in recent if math.isfinite(s.loss)]
        self.summary = {
            "rank": self.rank,
            "status": "aborted" if self._stop_reason else "completed",
            "stop_reason": self._stop_reason,
            "steps_completed": self.step_count,
            "steps_executed": self.tick,
            # Trained steps whose update was dropped (non-finite, overflow, OOM, skipped batch).
            "updates_skipped": sum(
                1 for st, sk in self._update_skipped.items() if sk and st < self.step_count
            ),
            # A single batch's loss is noisy: the mean of the last few training losses.
            "final_loss": sum(losses) / len(losses) if losses else None,
            "final_loss_over_steps": len(losses),
            "last_loss": recent[-1].loss if recent else None,
            "data_exhausted": self.data_exhausted,
            "epochs_started": self.cursor.epoch + 1,
            "skipped_batches": sorted(self.cursor.skipped),
            "learning": self.learning.summary(),
        }
        unfired = self.injector.not_reached(self.step_count)
        if unfired:
            # A chaos test whose fault never fired tested nothing: said, not left silent.
            self.summary["chaos_not_reached"] = unfired
            log.warning("chaos_fault_not_reached", rank=self.rank, faults=unfired)
        if self.flag_hold.on:
            # Each flagged step and whether the ranks held for its decision (workers.flag_hold).
            self.summary["flag_holds"] = list(self.flag_hold.holds)
        if self.resumed is not None:
            self.summary["resumed"] = self.resumed
        self.ctx.summary = self.summary
        if self._owns_controller:
            assert isinstance(self.reporter, LocalReporter | GroupReporter)
            self.reporter.close(self.summary)
        return self.summary

    def raise_if_aborted(self) -> None:
        if self._stop_reason is not None:
            raise RunAborted(self._stop_reason)


class LocalReporter:
    """Single-process mode: the controller runs in this process."""

    def __init__(
        self, controller: Controller, *, run_dir: RunDir | None = None, metrics: Any | None = None
    ) -> None:
        """`run_dir`: where the controller's journal goes (its `journal` writes there) and
        summary.json is written at the end; None: nowhere."""
        self.controller = controller
        self.run_dir = run_dir
        self.metrics = metrics  # a RunMetrics serving /metrics, when REMEDY_METRICS_PORT is set
        self._inbox: list[dict[str, Any]] = []
        self._started = time.time()

    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        self._inbox = self.controller.ingest(batch, now=time.time())
        write_journal(self.run_dir, self.controller.take_effects())
        if self.metrics is not None:
            self.metrics.observe(batch)
            self.metrics.goodput(self.controller.goodput, self._started)
            self.metrics.decisions(self.controller.decisions)

    def poll(self) -> list[dict[str, Any]]:
        out, self._inbox = self._inbox, []
        return out

    def close(self, rank_summary: dict[str, Any] | None = None) -> None:
        """End the run: resolve what is pending, write summary.json (with a run directory)."""
        c = self.controller
        c.finish()
        write_journal(self.run_dir, c.take_effects())
        if self.metrics is not None:
            self.metrics.goodput(c.goodput, self._started, force=True)
        if self.run_dir is None:
            return
        if rank_summary is not None:
            self.run_dir.write_summary(_local_summary(c, rank_summary, self._started, time.time()))
        self.run_dir.close()


def _local_summary(
    controller: Controller, rank: dict[str, Any], started: float, ended: float
) -> dict[str, Any]:
    """summary.json of a single-process run, in the shape `remedy run` writes (`remedy report`)."""
    c = controller
    completed = int(rank["steps_completed"])
    # Useful work: the steps kept whose update was applied, over every step executed
    # (a rollback's replays too), and the time they took over the wall time.
    goodput = c.goodput.summary(
        started=started,
        ended=ended,
        completed=completed,
        fallback_executed=int(rank["steps_executed"]),
        fallback_skipped=int(rank.get("updates_skipped", 0)),
    )
    status, degraded = final_status(
        "aborted" if c.abort_reason is not None else rank["status"], [rank]
    )
    return {
        "run_id": c.engine.run_id,
        "status": status,
        "degraded_reason": degraded,
        "abort_reason": c.abort_reason or rank.get("stop_reason"),
        "steps_completed": completed,
        **goodput,
        "final_loss": rank["final_loss"],
        "actions": dict(c.action_counts),
        "anomalies": dict(c.anomaly_counts),
        "outcomes": dict(c.outcome_counts),
        "decisions": len(c.decisions),
        "skipped_batches": rank["skipped_batches"],
        "workers": 1,
        "wall_s": round(ended - started, 2),
        "ranks": [rank],
    }


def _metrics_record(stats: StepStats, chaos: list[dict[str, Any]]) -> dict[str, Any]:
    record = stats.to_metrics()
    record.pop("nonfinite_param", None)  # goes with the event
    if chaos:
        record["chaos"] = chaos
    return record
