"""Process-group membership of one rank across generations.

The rendezvous store belongs to the supervisor side (`supervisor.rendezvous`);
generation N of the job's process group forms over `PrefixStore(f"gen{N}",
store)`, so any rank, rank 0 included, can be replaced. This object lives in
the rank's process and has two sides:

- the control side (the rank actor's control threads): `order` hands over
  the supervisor's order to form generation N from a given source rank,
  `status` answers pings;
- the training side (the Guard): `mark` records the boundary each step starts
  from. When a collective fails because a peer was lost, or a replacement
  reaches its first boundary, the rank enters the next generation through
  `rank.group.regroup`, the one place that does it, which uses this object's
  store, orders and record.
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
    def order(
        self, generation: int, source: int, store_addr: tuple[str, int] | None = None
    ) -> None:
        """The supervisor's order: form `generation`, adopting rank `source`'s state.

        `store_addr`: the rendezvous store to form it over; a supervisor that Ray
        restarted serves a new one (the old one died with its process).
        """
        self._orders.put((generation, source, store_addr))

    def use_store(self, store_addr: tuple[str, int] | None) -> None:
        """Form the next generation over the store at `store_addr` (None: the same one)."""
        if store_addr is not None and tuple(store_addr) != tuple(self.store_addr):
            self.store_addr = (str(store_addr[0]), int(store_addr[1]))
            self._store = None  # connected to in `join`

    def forget_store(self) -> None:
        """The store's server is gone: connect to it again at the next `join`."""
        self._store = None

    def release_sockets(self) -> int:
        """gloo: break off this generation's connections, so peers blocked on this rank are
        freed; how many were released (0 on NCCL)."""
        return self._sockets.release() if self.backend == "gloo" else 0

    def track_more_sockets(self) -> None:
        """Connections made since the world's (a sharded job's mesh and mirror groups) are
        released with them."""
        self._sockets.grow()

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
            self.track_more_sockets()
        self.at_boundary(guard)
        guard.send_report()

    def mark(self, guard: Guard) -> None:
        """The boundary this step starts from; `regroup` returns here if the step fails.

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

    @property
    def step_start(self) -> tuple[int, dict[str, Any]] | None:
        """The boundary the current step started from: (data position, RNG states)."""
        return self._mark

    def at_boundary(self, guard: Guard) -> None:
        """This rank is at a step boundary now (said in pings)."""
        self.phase = phases.BOUNDARY
        self.step, self.tick = guard.step_count, guard.tick

    def next_order(self) -> tuple[int, int, tuple[str, int] | None]:
        """The supervisor's next order to form a generation past this one; `GroupLostError`
        when none comes within REGROUP_WAIT_S."""
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


def warm_up() -> None:
    """Import now what a rank's first DDP construction and optimizer step import lazily.

    `DistributedDataParallel(...)` and the optimizers' `step` import
    `torch._dynamo` on first use: 0.7-1.6 s here, which a warm spare would
    otherwise spend on the critical path of a restart, with its peers waiting.
    """
    import torch._dynamo  # noqa: PLC0415
    import torch.nn.parallel  # noqa: F401, PLC0415


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
