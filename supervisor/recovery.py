"""Finding lost ranks and replacing only them: the supervisor side of `restart_rank`.

`check_hangs` runs in the supervisor's loop while the job is running: when
the hang watch suspects a rank it pings every rank and names the hung or
dead one (`HangWatch.judge`), which becomes a `rank_hang` / `rank_dead`
anomaly (source `supervisor`) for the policy like any other. The lost rank
leaves the targets of pending commands at once (`Controller.drop_rank`), so
a rollback waiting on it neither deadlocks nor holds the disruption budget.

When the policy answers `restart_rank`, `start` runs a targeted restart as
a task: kill the lost ranks, start a warm spare (else a new actor) as each
of them in the next generation, order the survivors to regroup from the
lowest healthy rank's state, and wait until every rank has completed a
step in the new generation. A replacement that fails is relaunched into the
same generation, with jittered back-off (tenacity), up to
`RunSpec.max_targeted_restarts` attempts (0: none); then the job state
machine moves to restarting-all and `_restart_all` kills every rank and
starts the whole group afresh in the next generation, warm spares first,
each rank resuming from the newest durable checkpoint every rank committed
(`committed_steps`; retired checkpoints of an abandoned timeline are never
among them), or from step 0 with the initial state when there is none. If
that fails too, every rank is stopped, the job moves to aborting and the
decision fails (the policy's `on_failure` follows). Each transition is
journaled with its reason.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from tenacity import AsyncRetrying, RetryError, stop_after_attempt, wait_random_exponential

from remedy.policies import AnomalyEvent, Decision
from remedy.supervisor.exceptions import SupervisorError
from remedy.supervisor.job_state import Phase, RanksLost, Regrouped, RestartFailed
from remedy.workers.checkpoint_store import checkpoint_tick, committed_steps

if TYPE_CHECKING:
    from remedy.supervisor.actor import SupervisorActor
    from remedy.supervisor.worker_group import WorkerGroup

log = structlog.get_logger("remedy.recovery")

# A replaced rank and its peers must each complete a step in the new
# generation within this long, or the attempt failed.
REGROUP_TIMEOUT_S = 120.0
# How long survivors get to catch the broken collective's error after the
# lost rank is killed (at least three times their p99 step time): gloo fails the
# blocked collectives of the killed rank's peers within ~50 ms here, and each
# survivor then breaks off its connections of the broken group
# (`workers.group_sockets`), failing the collectives of peers blocked on it. A
# survivor still blocked after this (where that cannot be done) is replaced too.
BLOCKED_GRACE_S = 0.3
# No second ping round for the same stall sooner than this.
PING_EVERY_S = 0.25


class RestartError(SupervisorError):
    """A targeted restart did not bring the group back; the message says why."""


class Recovery:
    """Hang checks and targeted restarts for one supervisor."""

    def __init__(self, sup: SupervisorActor, group: WorkerGroup) -> None:
        self.sup = sup
        self.group = group
        self.records: list[dict[str, Any]] = []  # one per restart, for the summary and benchmarks
        self._reported: set[tuple[int, int]] = set()  # (rank, incarnation) already reported lost
        self._detected_at: dict[int, float] = {}
        self._failed: dict[int, str] = {}  # replacement rank -> why it failed
        self._next_ping = 0.0
        self._task: asyncio.Task[None] | None = None
        self._front = 0  # the tick every rank must pass for a restart to count
        self._restarting: set[int] = set()  # every rank, while a full-group restart runs
        self._suspected_at = 0.0  # wall time the current stall was first suspected
        self._ping_started = 0.0  # wall time the latest ping round began
        self._marks: dict[str, float] = {}  # wall times of the restart in progress

    # ------------------------------------------------------------- detection
    async def check_hangs(self) -> None:
        now = time.monotonic()
        suspects = self.sup.watch.suspects(now)
        if not suspects:
            self._suspected_at = 0.0
            return
        self._suspected_at = self._suspected_at or time.time()
        if now < self._next_ping:
            return
        self._next_ping = now + PING_EVERY_S
        watch = self.sup.watch
        self._ping_started = time.time()
        pings = await self.group.ping_all(
            watch.config.ping_timeout_s, patience=watch.config.ping_patience
        )
        answered = time.monotonic()
        for rank, p in pings.items():
            # A rank that answers from inside its loop says how far it got: progress
            # the Guard has not reported yet (it reports every heartbeat_s) ends suspicion.
            if isinstance(p, dict) and p.get("phase") in ("step", "boundary"):
                watch.beat(rank, int(p.get("tick", -1)), answered)
        # Judged against who is still stalled after the ping (reports may have come meanwhile).
        verdict = watch.judge(pings, watch.suspects(answered), now=answered)
        for rank in verdict.hung:
            age = self.sup.watch.age(rank, now)
            self.lost(rank, "rank_hang", (
                f"rank {rank} made no progress for {age:.2f}s "
                f"(timeout {self.sup.watch.timeout(rank):.2f}s) and {verdict.reason}"
            ), details={"age_s": round(age, 3), "timeout_s": round(self.sup.watch.timeout(rank), 3)})  # fmt: skip
        for rank in verdict.dead:
            self.lost(rank, "rank_dead", f"rank {rank}'s process is gone")

    def lost(
        self, rank: int, kind: str, reason: str, *, details: dict[str, Any] | None = None
    ) -> None:
        """Report `rank` (its current incarnation) lost to the policy, once."""
        incarnation = self.sup.slots.incarnation(rank)
        if (rank, incarnation) in self._reported:
            return
        self._reported.add((rank, incarnation))
        if self._replacing(rank):
            self.replacement_failed(rank, reason)
            return
        # The slot is closed (its reports refused) only when a restart replaces it:
        # if the policy does not restart it, a slow rank that comes back still counts.
        self._detected_at[rank] = time.time()
        self._marks = {
            "suspected": self._suspected_at or self._detected_at[rank],
            "pinged": self._ping_started or self._detected_at[rank],  # the confirming round
        }
        c = self.sup.controller
        preempted = c.drop_rank(rank)
        ev = AnomalyEvent(
            kind=kind,
            rank=rank,
            # The step the group is stuck at: a hung rank's own reports may lag behind.
            step=max(c.step_of.values(), default=0),
            tick=max(c.tick_of.values(), default=0),
            severity="critical",
            source="supervisor",
            ts=time.time(),
            details={
                "reason": reason,
                "incarnation": incarnation,
                "preempted": preempted,
                **(details or {}),
            },
        )
        log.warning(kind, rank=rank, reason=reason)
        c.ingest({"rank": rank, "step": ev.step, "tick": ev.tick, "events": [ev.to_dict()]})

    def _restarting_all(self) -> bool:
        return self.sup.job.state.phase is Phase.RESTARTING_ALL

    def _replacing(self, rank: int) -> bool:
        """True while `rank` is being started by a restart (targeted or full-group)."""
        state = self.sup.job.state
        if state.phase is Phase.RECOVERING:
            return rank in state.lost
        return state.phase is Phase.RESTARTING_ALL and rank in self._restarting

    def replacement_failed(self, rank: int, why: str) -> None:
        if self._replacing(rank):
            self._failed[rank] = why

    # --------------------------------------------------------------- restart
    def start(self, d: Decision) -> None:
        """Begin a targeted restart of `d.ranks`; the decision resolves when it ends."""
        self._task = asyncio.get_running_loop().create_task(self._restart(d))

    async def settle(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _restart(self, d: Decision) -> None:
        sup = self.sup
        ranks = sorted(r for r in d.ranks if r in sup.slots.slots)
        sup.job.step(RanksLost(frozenset(ranks), f"{d.anomaly.kind} on rank {d.anomaly.rank}"))
        t_detect = min(self._detected_at.get(r, time.time()) for r in ranks)
        self._marks["restart"] = time.time()
        info: dict[str, Any] = {}
        why = "targeted restarts are off (max_targeted_restarts is 0)"
        if sup.job.state.phase is Phase.RECOVERING:
            try:
                async for attempt in AsyncRetrying(
                    stop=stop_after_attempt(sup.job.max_targeted),
                    wait=wait_random_exponential(multiplier=0.05, max=1.0),
                    reraise=False,
                ):
                    with attempt:
                        first = attempt.retry_state.attempt_number == 1
                        info = await self._attempt(ranks, first=first)
                    outcome = attempt.retry_state.outcome
                    if outcome is not None and outcome.failed:
                        sup.job.step(RestartFailed(str(outcome.exception())))
            except RetryError as exc:
                why = f"targeted restart failed: {exc.last_attempt.exception()}"
                if not self._restarting_all():
                    sup.controller.resolve_group_action(d.decision_id, "failed", why)
                    return
        if self._restarting_all():
            await self._full_restart(d, ranks, t_detect, why)
            return
        sup.job.step(Regrouped(info["generation"]))
        how = ", ".join(f"rank {r} by a {k}" for r, k in info["replacements"].items())
        await self._applied(
            d, info, ranks, t_detect,
            f"replaced {how}; generation {info['generation']} formed from rank "
            f"{info['source']}'s state",
        )  # fmt: skip

    async def _applied(
        self, d: Decision, info: dict[str, Any], ranks: list[int], t_detect: float, what: str
    ) -> None:
        """Record a restart that worked and resolve its decision `applied`."""
        t_stepped = time.time()
        pings = await self.group.ping_all(self.sup.watch.config.ping_timeout_s)
        record = {
            **info,
            "ranks": ranks,
            "anomaly": d.anomaly.kind,
            "detected_at": t_detect,
            "stepped_at": t_stepped,
            "detect_to_step_s": round(t_stepped - t_detect, 4),
            # Where the time went: the supervisor's marks and each rank's own.
            "timeline": {**self._marks, "detected": t_detect, "stepped": t_stepped},
            "rank_timelines": {
                str(r): p.get("timeline", {}) for r, p in pings.items() if isinstance(p, dict)
            },
            # A sharded job: where the shards came from (buddy, replica or dcp; workers.shard_mirror).
            "shard_restore": next(
                (p["restore"] for p in pings.values() if isinstance(p, dict) and p.get("restore")),
                None,
            ),
        }
        if record["shard_restore"]:
            r = record["shard_restore"]
            what += f"; shards from {r['source']} at step {r['step']}"
        self.records.append(record)
        self.sup.controller.resolve_group_action(
            d.decision_id,
            "applied",
            f"{what}; every rank stepped {record['detect_to_step_s']:.2f}s after detection",
            result=record,
        )
        self.group.refill_spares()

    # ------------------------------------------------------ full-group restart
    async def _full_restart(self, d: Decision, lost: list[int], t_detect: float, why: str) -> None:
        """Restart every rank from the last committed checkpoint; resolve `d` either way."""
        sup = self.sup
        try:
            info = await self._restart_all()
        except RestartError as exc:
            self._restarting.clear()
            sup.job.step(RestartFailed(str(exc)))
            self.group.kill_all()  # nothing left to supervise: the run ends
            sup.controller.resolve_group_action(
                d.decision_id, "failed", f"{why}; full-group restart failed: {exc}"
            )
            return
        self._restarting.clear()
        sup.job.step(Regrouped(info["generation"], info["resumed"]))
        await self._applied(
            d, info, lost, t_detect,
            f"{why}; restarted every rank in generation {info['generation']} {info['resumed']}",
        )  # fmt: skip

    async def _restart_all(self) -> dict[str, Any]:
        """Kill every rank, start them all in a new generation from the last committed checkpoint."""
        sup = self.sup
        c = sup.controller
        world = list(range(sup.spec.workers))
        directory = Path(sup.spec.run_dir) / "checkpoints"
        steps = committed_steps(directory, sup.spec.workers)
        resume = steps[-1] if steps else None
        # The steps redone: from the checkpoint to the furthest step a rank reported.
        reached = max((m.step for r, m in c._marks.items() if r in world), default=0)
        if resume is None:
            resumed = "from step 0 with the initial state: no checkpoint is committed by every rank"
            floor = 0
        else:
            resumed = (
                f"from checkpoint step {resume}, the newest of the steps every rank "
                f"committed: {', '.join(map(str, steps))}"
            )
            floor = checkpoint_tick(directory, resume) or 0
        sup.run_dir.wal({
            "type": "full_restart", "resume_step": resume, "committed_steps": steps,
            "reached_step": reached, "reason": f"restarting every rank {resumed}",
        })  # fmt: skip
        self._restarting = set(world)
        self._failed.clear()
        for r in world:
            self._reported.add((r, sup.slots.incarnation(r)))
            sup.slots.lose(r)
        info = await self.group.restart_all(resume)
        self._reissue_pending()
        now = time.monotonic()
        for r in world:
            c.tick_of[r] = -1
            c.forget_rank(r)
            sup.watch.started(r, now)
        deadline = now + REGROUP_TIMEOUT_S
        # Each rank reports once when its Guard exists (tick 0), then resumes at the
        # checkpoint's tick: a tick past it is a step completed in the new generation.
        while not all(c.tick_of.get(r, -1) > floor for r in world):
            failed = {r: why for r, why in self._failed.items() if r in world}
            if failed:
                raise RestartError(
                    "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
                )
            if time.monotonic() > deadline:
                raise RestartError(f"the group did not step within {REGROUP_TIMEOUT_S:g}s")
            await asyncio.sleep(0.005)
        return {
            **info,
            "resumed": resumed,
            "reached_step": reached,
            "steps_lost": max(reached - (resume or 0), 0),
        }

    def _reissue_pending(self) -> None:
        """Every rank of the new generation gets every pending command again.

        The ranks resume from a checkpoint older than any answer the old
        processes gave, so an answer from before the restart does not count:
        a command applied by some of the old ranks is applied by all new ones.
        """
        world = set(range(self.sup.spec.workers))
        for pending in self.sup.controller.pending.values():
            pending.outcomes.clear()
            pending.dropped.clear()
            pending.targets = set(world)

    async def _blocked(self, live: list[int]) -> list[int]:
        """Survivors that have not caught the broken collective's error after a grace period."""
        sup = self.sup
        grace = max(BLOCKED_GRACE_S, *(3 * sup.watch.p99(r) for r in live))
        deadline = time.monotonic() + grace
        while True:
            pings = await self.group.ping_all(sup.watch.config.ping_timeout_s, ranks=live)
            still = [
                r
                for r in live
                if not (isinstance(pings[r], dict) and pings[r].get("phase") == "recovering")
            ]
            if not still or time.monotonic() > deadline:
                return still
            await asyncio.sleep(0.02)

    async def _attempt(self, ranks: list[int], *, first: bool) -> dict[str, Any]:
        sup = self.sup
        c = sup.controller
        world = range(sup.spec.workers)
        live = [r for r in world if r not in ranks]
        if not live:
            raise RestartError("no healthy rank is left to take the state from")
        for r in ranks:
            self._failed.pop(r, None)
            sup.slots.lose(r)
        if first:
            front = max(c.tick_of.get(r, 0) for r in live)
            for r in ranks:
                self.group.kill(r)
            self._marks["killed"] = time.time()
            if sup.spec.gpus_per_rank:
                # NCCL kernels keep spinning after a peer dies: abort the survivors'
                # communicators from their control threads (a no-op on gloo ranks).
                await asyncio.gather(*(self.group.actors[r].abort.remote() for r in live))
            blocked = await self._blocked(live)
            self._marks["survivors_checked"] = time.time()
            if blocked:
                # gloo: a survivor waiting on a peer that itself left the collective
                # (not on the killed rank) stays blocked until that peer's process
                # exits; it is replaced too, from a survivor that did recover.
                for r in blocked:
                    self._reported.add((r, sup.slots.incarnation(r)))
                    sup.slots.lose(r)
                    c.drop_rank(r)
                    self.group.kill(r)
                sup.job.step(
                    RanksLost(frozenset(blocked), "still blocked in the broken collective")
                )
                ranks[:] = sorted({*ranks, *blocked})
                live = [r for r in live if r not in blocked]
                if not live:
                    raise RestartError("no survivor recovered from the broken collective")
            info = await self.group.replace(ranks, source=min(live))
            self._marks["launched"] = time.time()
            info["blocked"] = blocked
        else:
            front = self._front
            info = await self.group.relaunch(ranks, source=min(live))
        self._front = front
        now = time.monotonic()
        for r in ranks:
            c.tick_of[r] = -1
            sup.watch.started(r, now)
        for r in live:
            sup.watch.allow(r, REGROUP_TIMEOUT_S, now)
        deadline = now + REGROUP_TIMEOUT_S
        while not all(c.tick_of.get(r, -1) > front for r in world):
            failed = {r: why for r, why in self._failed.items() if r in ranks}
            if failed:
                raise RestartError("; ".join(f"rank {r}: {why}" for r, why in failed.items()))
            if time.monotonic() > deadline:
                raise RestartError(f"the group did not step within {REGROUP_TIMEOUT_S:g}s")
            await asyncio.sleep(0.005)
        for r in world:
            sup.watch.settle(r)  # back to step-time timeouts: a second hang is found as fast
        return info
