"""The I/O of a targeted restart: what `Recovery` does for each effect of `control.restart`.

Each function here carries out one step of the restart machine against the
rank actors (kill, abort collectives, check the survivors, launch, see
whether a crashed supervisor's launch formed, back off) and returns the
machine's input for what happened, or the answer the caller feeds on. What
the machine decides, and the control state a step changes (slots, losses,
pending commands), stay with the caller: nothing here writes them.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from remedy.control import restart
from remedy.protocol import phases
from remedy.protocol.phases import JOINING, RECOVERING
from remedy.rank.state.checkpoint_store import checkpoint_tick, committed_steps
from remedy.supervisor import waits

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping

    from remedy.policies import Decision
    from remedy.supervisor.worker_group import WorkerGroup

# How long survivors get to catch the broken collective's error after the
# lost rank is killed (at least three times their p99 step time): gloo fails the
# blocked collectives of the killed rank's peers within ~50 ms here, and each
# survivor then breaks off its connections of the broken group
# (`workers.group_sockets`), failing the collectives of peers blocked on it. A
# survivor still blocked after this (where that cannot be done) is replaced too.
BLOCKED_GRACE_S = 0.3
# How much longer than the grace a survivor that answers no ping at all gets
# before it counts as blocked (a restarted supervisor's first calls are slow),
# and every survivor gets when none has caught the error yet.
SILENT_GRACE_S = 5.0
# How long the survivors' control threads get to abort their NCCL communicators.
ABORT_S = 10.0


def kill(group: WorkerGroup, ranks: tuple[int, ...], front: int) -> restart.Killed:
    """Kill `ranks`' processes; `front`: the survivors' newest tick before."""
    for r in ranks:
        group.kill(r)
    return restart.Killed(front)


async def abort_collectives(group: WorkerGroup, live: tuple[int, ...]) -> None:
    """NCCL kernels keep spinning after a peer dies: abort the survivors' communicators
    from their control threads (a no-op on gloo ranks)."""
    await waits.within(
        asyncio.gather(*(group.actors[r].abort.remote() for r in live)),
        ABORT_S,
        "the survivors' communicator aborts",
    )


async def blocked_survivors(
    group: WorkerGroup,
    live: list[int],
    *,
    grace_s: float,
    ping_timeout_s: float,
    joining: Callable[[], Collection[int]],
) -> restart.Checked:
    """Survivors that have not caught the broken collective's error after `grace_s`
    (`blocked`); those still joining a generation (`stuck`): no generation is being formed
    now (the ranks it needed were just killed, or it was abandoned), so one still in its
    rendezvous after the grace waits there for a peer that is gone (`phases.JOINING`); and
    those under a framework's loop, which never re-form the group (`phases.regroups`), at
    once (`framework`). A survivor `joining` the restart meanwhile is not waited on."""
    deadline = time.monotonic() + grace_s
    while True:
        live = [r for r in live if r not in joining()]
        if not live:
            return restart.Checked()
        pings = await group.ping_all(ping_timeout_s, ranks=live)
        still = [r for r in live if phases.of(pings[r]) != RECOVERING]
        # A survivor under a framework's loop never re-forms the group: nothing to wait for.
        waiting = [r for r in still if phases.regroups(pings[r]) is not False]
        # A survivor that answered nothing yet is not known to be blocked: the first
        # calls of a restarted supervisor to the ranks it adopted can be slow.
        silent = [r for r in still if not isinstance(pings[r], dict)]
        # Every survivor still blocked: replacing them all cannot work (no rank
        # would be left to take the state from), so more time costs nothing there;
        # on a loaded node their error handlers may just not have run yet.
        extra = SILENT_GRACE_S if silent or len(still) == len(live) else 0.0
        # A survivor in a phase of its loop's own (an evaluation between two steps) is not in
        # the broken collective: it meets the error at its next one, within the phase's bound.
        now = time.monotonic()
        for r in waiting:
            left = phases.phase_left_s(pings[r])
            if left is not None:
                deadline = max(deadline, now + left)
        if not waiting or now > deadline + extra:
            stuck = [r for r in still if phases.of(pings[r]) == JOINING]
            framework = [r for r in still if r not in waiting and r not in stuck]
            blocked = [r for r in still if r not in stuck and r not in framework]
            return restart.Checked(tuple(blocked), (), tuple(stuck), tuple(framework))
        await asyncio.sleep(0.02)


async def launch(
    group: WorkerGroup, ranks: tuple[int, ...], source: int, *, retry: bool
) -> restart.Launched:
    """Start `ranks` in the next generation from `source`'s state; survivors ordered to form it."""
    info = await group.replace(list(ranks), source=source, retry=retry)
    return restart.Launched(info, time.time())


async def formed(
    group: WorkerGroup, generation: int, workers: int, *, ping_timeout_s: float, patience: float
) -> restart.Formed:
    """Whether every rank answers from `generation`: the crashed supervisor's restart took."""
    pings = await group.ping_all(ping_timeout_s, patience=patience)
    # A rank still joining it has not formed it (and may never: `phases.JOINING`).
    return restart.Formed(
        all(
            r in pings
            and isinstance(pings[r], dict)
            and pings[r].get("generation") == generation
            and phases.of(pings[r]) != JOINING
            for r in range(workers)
        )
    )


async def backoff(attempts: int, joined: Callable[[], Collection[int]]) -> restart.Waited:
    """A jittered exponential pause before the next attempt (at most 1 s); then the ranks
    that `joined` the restart meanwhile."""
    await asyncio.sleep(random.uniform(0, min(1.0, 0.05 * 2**attempts)))
    return restart.Waited(tuple(sorted(joined())))


async def where_they_are(group: WorkerGroup, ranks: list[int], ping_timeout_s: float) -> str:
    """Each rank's phase and generation as its ping tells them, for a restart that timed out."""
    present = [r for r in ranks if r in group.actors]
    pings = await group.ping_all(ping_timeout_s, ranks=present)
    return ", ".join(
        f"rank {r}: {p.get('phase')} in generation {p.get('generation')} at tick {p.get('tick')}"
        if isinstance(p, dict)
        else f"rank {r}: {p}"
        for r, p in sorted(pings.items())
    )


async def phase_left(group: WorkerGroup, ranks: list[int], ping_timeout_s: float) -> float:
    """Seconds a restart past its deadline waits on `ranks` (those not stepped yet): while
    each answers from a phase of its loop's own within its bound (a loop that evaluates at
    the step it resumed from, on every rank), the soonest end of their bounds (at least
    0.5 s); else 0, the attempt failed."""
    present = [r for r in ranks if r in group.actors]
    if not ranks or len(present) < len(ranks):
        return 0.0
    pings = await group.ping_all(ping_timeout_s, ranks=present)
    lefts = [phases.phase_left_s(pings.get(r)) for r in present]
    known = [left for left in lefts if left is not None]
    return max(min(known), 0.5) if len(known) == len(lefts) else 0.0


async def lead_executed(group: WorkerGroup, lead: int | None, ping_timeout_s: float) -> int | None:
    """How many steps rank `lead` had executed, by its ping, before a full-group restart kills
    it: a rank in a broken collective may not have reported its last steps, which were
    executed all the same (`GoodputLedger.expect_reach`). None when it is gone or silent."""
    if lead not in group.actors:
        return None
    answer = (await group.ping_all(ping_timeout_s, ranks=[lead]))[lead]
    step = answer.get("step") if isinstance(answer, dict) else None
    return step if type(step) is int and step >= 0 else None


async def restart_record(
    group: WorkerGroup,
    d: Decision,
    info: dict[str, Any],
    ranks: list[int],
    *,
    detected: float,
    marks: Mapping[str, float],
    ping_timeout_s: float,
) -> dict[str, Any]:
    """The record of a restart that worked: the launch's `info`, when it was `detected` and
    when every rank stepped, and where the time went (the supervisor's `marks` and each
    rank's own timeline, by a ping)."""
    stepped = time.time()
    pings = await group.ping_all(ping_timeout_s)
    return {
        **info,
        "ranks": ranks,
        "anomaly": d.anomaly.kind,
        "detected_at": detected,
        "stepped_at": stepped,
        "detect_to_step_s": round(stepped - detected, 4),
        "timeline": {**marks, "detected": detected, "stepped": stepped},
        "rank_timelines": {
            str(r): p.get("timeline", {}) for r, p in pings.items() if isinstance(p, dict)
        },
        # A sharded job: where the shards came from (buddy, replica or dcp; workers.shard_mirror).
        "shard_restore": next(
            (p["restore"] for p in pings.values() if isinstance(p, dict) and p.get("restore")),
            None,
        ),
    }


@dataclass(frozen=True)
class ResumePoint:
    """Where a full-group restart resumes: the newest checkpoint every rank committed."""

    step: int | None  # None: from step 0 with the initial state
    committed: list[int]  # the steps every rank committed
    floor: int  # the checkpoint's tick: a tick past it is a step of the new generation
    resumed: str  # as people read it

    @classmethod
    def of(cls, run_dir: str, workers: int) -> ResumePoint:
        """Read from the run's checkpoints (retired ones of an abandoned timeline are not
        among the committed)."""
        directory = Path(run_dir) / "checkpoints"
        steps = committed_steps(directory, workers)
        if not steps:
            why = "no checkpoint is committed by every rank"
            return cls(None, steps, 0, f"from step 0 with the initial state: {why}")
        resumed = (
            f"from checkpoint step {steps[-1]}, the newest of the steps every rank "
            f"committed: {', '.join(map(str, steps))}"
        )
        return cls(steps[-1], steps, checkpoint_tick(directory, steps[-1]) or 0, resumed)
