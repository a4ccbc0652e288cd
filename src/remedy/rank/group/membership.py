"""Process-group membership of one rank across generations.

The rendezvous store belongs to the supervisor side (`supervisor.rendezvous`);
generation N of the job's process group forms over `PrefixStore(f"gen{N}",
store)`, so any rank, rank 0 included, can be replaced. This object lives in
the rank's process and has two sides:

- the control side (the rank actor's control threads): `regroup` hands
  over the supervisor's order to form generation N from a given source rank,
  `status` answers pings;
- the training side (the Guard): `mark` records the boundary each step starts
  from; when a collective fails because a peer was lost, `recover` records
  the error inside the step instead of raising, leaves the broken group, forms
  the next generation in this process (DDP rebuilt on it) and adopts one
  state broadcast from the source rank. A replacement rank adopts the same
  broadcast at its first boundary (`adopt_if_joining`). If the generation
  fails while it forms (a replacement dies before the broadcast is done),
  the survivor leaves it too and waits for the order to form the next one.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from remedy.protocol import phases
from remedy.rank.exceptions import GroupLostError
from remedy.rank.group.group_sockets import GroupSockets
from remedy.rank.state import shard_mirror, train_state
from remedy.rank.state.snapshots import restore_rng

if TYPE_CHECKING:
    from remedy.rank.guard import Guard

log = structlog.get_logger("remedy.membership")

# Collectives and rendezvous time out after this long. remedy finds a hung
# rank itself in about a second, so this is only the last resort; the
# environment variable wins over the constant.
COLLECTIVE_TIMEOUT_ENV = "REMEDY_COLLECTIVE_TIMEOUT_S"
COLLECTIVE_TIMEOUT_S = 1800.0
# How long a survivor waits for the supervisor's order to regroup after a
# collective failed.
REGROUP_WAIT_S = 120.0
# How long a rank tries to connect to the rendezvous store. torch retries a
# connection that is refused until the store's timeout (the collective timeout,
# 30 min): a store whose supervisor died before this rank connected would hold
# it that long, while the supervisor Ray restarts orders it again within seconds.
STORE_CONNECT_S = 10.0

_FAILURE_WORDS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "gloo",
    "nccl",
    "process group",
    "processgroup",
    "timed out",
)


def collective_timeout() -> datetime.timedelta:
    return datetime.timedelta(
        seconds=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, COLLECTIVE_TIMEOUT_S))
    )


def is_group_failure(exc: BaseException) -> bool:
    """True for the errors a collective raises when a peer hangs, dies or its group is aborted."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _FAILURE_WORDS)


class Membership:
    """This rank's place in the job's current process-group generation."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store_addr: tuple[str, int],
        generation: int = 0,
        adopt_from: int | None = None,
        backend: str | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store_addr = store_addr
        self.generation = generation
        self.adopt_from = adopt_from  # set on a replacement: adopt this rank's state first
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._store: Any = None
        self._sockets = GroupSockets()  # gloo: this generation's connections, to break off
        # Orders to regroup: (generation, source, the store's address or None for the same).
        self._orders: queue.Queue[tuple[int, int, tuple[str, int] | None]] = queue.Queue()
        self._lock = threading.Lock()
        self._mark: tuple[int, dict[str, Any]] | None = None
        self.phase = phases.STARTING
        # Whether this rank survives a lost peer by re-forming the group (a Guard does); False
        # once a framework's loop is known to drive it (`framework_loop`); None: not known yet.
        self.regroups: bool | None = None
        self.step = 0
        self._tick = 0
        # Wall time this process's tick last moved: its own progress mark, which a supervisor
        # that was away judges a stall from (`control.progress_marks`).
        self.moved_at = time.time()
        self.steps_run = 0  # steps this process began (a replacement's adopted tick is none)
        self.recoveries = 0
        self.last_recovery: dict[str, Any] = {}
        self.last_restore: dict[str, Any] = {}  # a sharded job: where the shards came from
        # Wall-clock times of this process's latest recovery (or, on a replacement,
        # its start), for the supervisor's recovery record: where the time went.
        self.timeline: dict[str, float] = {"started": time.time()}
        self.inbox: Any = None  # the Guard's command inbox, once attached (`identity`)
        # The loop's own phase now (`rank.loop.phases`), once a Guard is attached.
        self._loop_phase: Any = None

    # ------------------------------------------------------------ generations
    def join(self) -> None:
        """Form (or join) the current generation's process group in this process."""
        if self._store is None:
            self._store = self._connect()
        if self.backend == "nccl":
            torch.cuda.set_device(0)
        with self._sockets.around():
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(f"gen{self.generation}", self._store),
                rank=self.rank,
                world_size=self.world_size,
                timeout=collective_timeout(),
            )
        self.timeline["joined"] = time.time()

    def _connect(self) -> Any:
        """A client of the rendezvous store; DistNetworkError when none answers within STORE_CONNECT_S."""
        host, port = self.store_addr
        store = dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=STORE_CONNECT_S),
            wait_for_workers=False,
        )
        store.set_timeout(collective_timeout())  # its waits: as long as a collective's
        return store

    def leave(self) -> None:
        """Leave the current group (a broken one included)."""
        if dist.is_initialized():
            if self.backend == "nccl":
                abort_collectives()
            dist.destroy_process_group()

    # ----------------------------------------------------------- control side
    def regroup(
        self, generation: int, source: int, store_addr: tuple[str, int] | None = None
    ) -> None:
        """The supervisor's order: form `generation`, adopting rank `source`'s state.

        `store_addr`: the rendezvous store to form it over; a supervisor that Ray
        restarted serves a new one (the old one died with its process).
        """
        self._orders.put((generation, source, store_addr))

    def _use_store(self, store_addr: tuple[str, int] | None) -> None:
        """Form the next generation over the store at `store_addr` (None: the same one)."""
        if store_addr is not None and tuple(store_addr) != tuple(self.store_addr):
            self.store_addr = (str(store_addr[0]), int(store_addr[1]))
            self._store = None  # connected to in `join`

    @property
    def tick(self) -> int:
        return self._tick

    @tick.setter
    def tick(self, value: int) -> None:
        if value != self._tick:
            self.moved_at = time.time()
        self._tick = value

    def status(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "generation": self.generation,
            "phase": self.phase,
            "regroups": self.regroups,
            "step": self.step,
            "tick": self.tick,
            "moved_at": round(self.moved_at, 3),
            "steps_run": self.steps_run,
            "pid": os.getpid(),
            "recoveries": self.recoveries,
            "timeline": dict(self.timeline),
            "restore": dict(self.last_restore),
            "loop_phase": self._loop_phase() if self._loop_phase is not None else None,
        }

    # ---------------------------------------------------------- training side
    def framework_loop(self) -> None:
        """A framework's loop drives this rank (`integrations`: Lightning's, Hugging Face's):
        a failed collective (the callbacks' agreement on commands, or one of the framework's
        own) is raised through the framework's loop and ends it, not survived, so this rank
        never leaves a broken group to re-form the next one. The
        supervisor then replaces it at once instead of waiting for it to (`phases.regroups`)."""
        self.regroups = False

    def attach(self, guard: Guard) -> None:
        """The Guard exists: say so at once, which ends the supervisor's start-up allowance."""
        self.timeline["guard"] = time.time()
        self.inbox = guard.inbox
        self._loop_phase = guard.phases.status
        self.regroups = True
        if guard.sharded:  # its mesh's groups and the mirror's: released with the world's
            self._sockets.grow()
        self.phase = phases.BOUNDARY
        self.step, self.tick = guard.step_count, guard.tick
        guard.send_report()

    def mark(self, guard: Guard) -> None:
        """The boundary this step starts from; `recover` returns here if the step fails.

        The Guard has just marked it (`guard.step_mark`: the RNG states, taken once
        for this and for replay_step)."""
        mark = guard.step_mark
        assert mark is not None
        self._mark = (mark.cursor, mark.rng)
        if "adopted" in self.timeline and "next_step" not in self.timeline:
            self.timeline["next_step"] = time.time()
        self.phase = phases.STEP
        self.steps_run += 1
        self.step, self.tick = guard.step_count, guard.tick

    def adopt_if_joining(self, guard: Guard) -> None:
        """A replacement's first boundary: adopt the source rank's state with every peer."""
        if self.adopt_from is None:
            return
        source, self.adopt_from = self.adopt_from, None
        t0 = time.perf_counter()
        self.timeline["adopting"] = time.time()
        guard.injector.on_join()  # chaos: a kill_rank that kills replacements too
        # No peer holds a sharded rank's shard whole: it comes from its buddy (shard_mirror).
        if guard.sharded:
            self.last_restore = shard_mirror.restore_group(guard, fresh=True)
        else:
            state = train_state.broadcast(guard, src=source, joining=True)
            relayout_ddp(guard, state.get("ddp_buckets"))
        self.timeline["adopted"] = time.time()
        guard.report_regrouped()  # report the first step of the new generation at once
        self.phase = phases.BOUNDARY
        self.step, self.tick = guard.step_count, guard.tick
        log.info("state_adopted", rank=self.rank, source=source, step=guard.step_count,
                 seconds=round(time.perf_counter() - t0, 4))  # fmt: skip

    def recover(self, guard: Guard, exc: BaseException, *, in_step: bool) -> bool:
        """After a failed collective: regroup and adopt the source's state; False if not a group failure.

        Raises `GroupLostError` when no order to regroup comes in time.
        """
        if self.world_size <= 1 or not is_group_failure(exc):
            return False
        t0 = time.perf_counter()
        self.timeline = {"error": time.time()}
        self.phase = phases.RECOVERING
        # gloo: peers still blocked on this rank (not on the lost one) stay blocked
        # while this process holds the broken group's connections; break them off
        # now, before waiting for the order, so only the lost rank is replaced.
        released = self._sockets.release() if self.backend == "gloo" else 0
        self.timeline["released"] = time.time()
        log.warning(
            "collective_failed",
            rank=self.rank,
            step=guard.step_count,
            error=str(exc)[:200],
            released=released,
        )
        # The steps run since the last report reach the supervisor now: this process
        # may be killed while it waits (a full-group restart), and they were executed.
        # The report says the collective failed: the supervisor looks for the lost peer
        # at once, where its silence would take the hang watch's timeout to show.
        guard.send_report(collective_failed=True)
        generation, source, store_addr = self._next_order()
        self.timeline["order"] = time.time()
        if in_step and self._mark is not None:
            # The failed step is discarded: back to the boundary it started from.
            position, rng = self._mark
            guard.cursor.position = position
            step_mark = guard.step_mark
            if not guard.cursor.rewindable and step_mark is not None and step_mark.batch_index >= 0:
                # A plain iterable cannot read the step's batch again: it is given back, so
                # this rank trains it next, as a replacement that catches up to this position
                # does (the rank would otherwise run one batch ahead of its peers, and out of
                # data a step before them).
                guard.cursor.unread([(step_mark.batch_index, step_mark.batch)])
            restore_rng(rng)
            guard.optimizer.zero_grad(set_to_none=True)
        if guard.mirror is not None:
            # Its exchange fails (its sockets are released) before its group.
            guard.mirror.wait()
        self.leave()
        self.timeline["left"] = time.time()
        captured = None
        formed = self.generation  # the last generation this process was part of
        overwritten = False  # its live state may hold a failed generation's start-up sync
        while True:
            if self.rank == source and captured is None and not guard.sharded:
                if overwritten:
                    raise GroupLostError(
                        f"rank {self.rank}: ordered to be the source of generation {generation}, "
                        "but its state may hold the start-up sync of a generation that failed "
                        "while it formed"
                    )
                # Taken before DDP's re-initialisation, whose start-up sync copies rank 0's
                # parameters, and rank 0 may be a fresh replacement.
                captured = {
                    **train_state.capture(guard),
                    "ddp_buckets": ddp_bucket_layout(guard.model),
                }
            elif self.rank != source:
                captured = None
            self.generation = generation
            self._use_store(store_addr)
            # Said in pings: a rendezvous can wait forever for a peer that died in it (see
            # phases.JOINING), and only the supervisor can end that wait, by replacing this rank.
            self.phase = phases.JOINING
            try:
                self.join()  # rendezvous: STORE_CONNECT_S to connect, collective_timeout() to form
            except (RuntimeError, dist.DistError) as failed:
                # The rendezvous itself failed: the supervisor closed its store (its next
                # attempt forms the next generation over a new one), or the supervisor
                # serving it died (the one Ray restarts orders the group again, with its store).
                log.warning("rendezvous_failed", rank=self.rank, generation=generation,
                            error=str(failed)[:200])  # fmt: skip
                self.leave()
                _forget_failed_group()
                if isinstance(failed, dist.DistNetworkError):
                    self._store = None  # its server is gone: connect again for the next order
                self.generation = formed  # not part of `generation`: any order past it counts
                generation, source, store_addr = self._next_order()
                continue
            joined = time.perf_counter()
            self.phase = phases.RECOVERING  # formed: adopting the source's state
            try:
                self._adopt_in_group(guard, source, captured)
                break
            except Exception as failed:
                if not is_group_failure(failed):
                    raise
                # A peer was lost while the generation formed (a replacement that died as
                # it adopted the state): this generation is over, and the supervisor's next
                # attempt orders the next one. Peers still blocked on this rank are freed.
                released = self._sockets.release() if self.backend == "gloo" else 0
                log.warning("regroup_failed", rank=self.rank, generation=generation,
                            error=str(failed)[:200], released=released)  # fmt: skip
                self.leave()
                formed = generation
                overwritten = overwritten or self.rank != source
                generation, source, store_addr = self._next_order()
        self.timeline["adopted"] = time.time()
        guard.report_regrouped()  # report the first step of the new generation at once
        self.recoveries += 1
        self.last_recovery = {
            "generation": generation,
            "source": source,
            "rendezvous_s": round(joined - t0, 4),
            "total_s": round(time.perf_counter() - t0, 4),
        }
        self.phase = phases.BOUNDARY
        self.step, self.tick = guard.step_count, guard.tick
        log.warning("regrouped", rank=self.rank, **self.last_recovery)
        return True

    def _adopt_in_group(self, guard: Guard, source: int, captured: dict[str, Any] | None) -> None:
        """In the generation just formed: rebuild DDP on it and adopt rank `source`'s state
        (`captured`: the source's own, taken before the rebuild); a sharded rank keeps its shard."""
        guard.use_group(dist.group.WORLD)
        if guard.sharded:  # each survivor keeps its own shard (shard_mirror)
            shard_mirror.regroup(guard)
            self._sockets.grow()
            self.last_restore = shard_mirror.restore_group(guard, fresh=False)
        else:
            rebuild_ddp(guard)
            self.timeline["ddp"] = time.time()
            state = train_state.broadcast(guard, src=source, state=captured)
            relayout_ddp(guard, state.get("ddp_buckets"))

    def _next_order(self) -> tuple[int, int, tuple[str, int] | None]:
        deadline = time.monotonic() + REGROUP_WAIT_S
        self.phase = phases.RECOVERING
        while True:
            left = deadline - time.monotonic()
            try:
                generation, source, store_addr = self._orders.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise GroupLostError(
                    f"rank {self.rank}: a collective failed and no order to regroup came within "
                    f"{REGROUP_WAIT_S:g}s"
                ) from None
            if generation > self.generation:
                return generation, source, store_addr


def _forget_failed_group() -> None:
    """After an `init_process_group` that failed, name the next group as a fresh process would.

    torch names the default group from a counter (`_world.group_count`) that
    the failed call advanced and that only `destroy_process_group` resets; the
    rendezvous keys carry the name, so a survivor whose rendezvous failed once
    waited under "1/" while a fresh replacement waited under "0/", forever.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0


def warm_up() -> None:
    """Import now what a rank's first DDP construction and optimizer step import lazily.

    `DistributedDataParallel(...)` and the optimizers' `step` import
    `torch._dynamo` on first use: 0.7-1.6 s here, which a warm spare would
    otherwise spend on the critical path of a restart, with its peers waiting.
    """
    import torch._dynamo  # noqa: PLC0415
    import torch.nn.parallel  # noqa: F401, PLC0415


def rebuild_ddp(guard: Guard) -> None:
    """Re-initialise a DDP model on the current default group, keeping its settings.

    The optimizer holds the module's parameters, which stay the same tensors;
    only DDP's reducer and its hooks are rebuilt. Detectors that timed the old
    reducer's all-reduces attach to the new one.
    """
    model = guard.model
    ddp = torch.nn.parallel.DistributedDataParallel
    if not isinstance(model, ddp):
        return
    ddp.__init__(
        model,
        model.module,
        device_ids=model.device_ids,
        output_device=model.output_device,
        dim=model.dim,
        # Not the deprecated broadcast_buffers (a FutureWarning in the user's output at every
        # replacement). Unlike it, this syncs buffers at init even when False: harmless here,
        # where every rank of the new group adopts one rank's state anyway.
        forward_sync_buffers=model.forward_sync_buffers,
        bucket_cap_mb=model.bucket_bytes_cap / (1024 * 1024),
        find_unused_parameters=model.find_unused_parameters,
        gradient_as_bucket_view=model.gradient_as_bucket_view,
        static_graph=model.static_graph,
    )
    _reattach_timers(guard)


def ddp_bucket_layout(model: Any) -> list[list[int]] | None:
    """A DDP model's gradient buckets as parameter indices, in the reducer's order."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    params, _ = model._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(params)}
    buckets = model.reducer._get_zeros_like_grad_buckets()
    return [[index[id(p)] for p in bucket.parameters()] for bucket in buckets]


def relayout_ddp(guard: Guard, layout: list[list[int]] | None) -> None:
    """Give a DDP model a fresh reducer whose buckets are `layout` (no collectives).

    A new DDP starts with buckets in reverse parameter order and rebuilds them
    after its first step from the order gradients arrived in. A long-running
    rank has rebuilt them already; gloo and NCCL sum each element in an order
    that depends on where it sits in its bucket, so a replacement (and the
    survivors, whose DDP was re-initialised) take the source's layout to give
    the same bits as a run that never lost a rank.
    """
    model = guard.model
    if layout is None or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    params, sparse = model._build_params_for_reducer()
    limit = model.bucket_bytes_cap
    original = dist._compute_bucket_assignment_by_size

    def fixed(*_args: Any, **_kwargs: Any) -> tuple[list[list[int]], list[int]]:
        # DDP reverses what this returns before building its reducer.
        return list(reversed(layout)), [limit] * len(layout)

    dist._compute_bucket_assignment_by_size = fixed
    try:
        model._ddp_init_helper(
            params, sparse, model._build_debug_param_to_name_mapping(params), model.static_graph
        )
    finally:
        dist._compute_bucket_assignment_by_size = original
    _reattach_timers(guard)


def _reattach_timers(guard: Guard) -> None:
    """Detectors that timed the old reducer's all-reduces attach to the new one."""
    for detector in guard.detectors.detectors:
        d: Any = detector
        if getattr(d, "timer", None) is not None and callable(getattr(d, "attach", None)):
            d.timer = None
            d.attach(guard.model)


def abort_collectives() -> None:
    """NCCL: abort every communicator of this process from any thread, so a blocked kernel returns.

    Killing a hung peer unblocks gloo; NCCL kernels keep spinning until the
    communicator is aborted. A no-op where nothing is initialised.
    """
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if callable(abort):
        abort()
        return
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))  # type: ignore[union-attr]
    backend.abort()
