"""Finding lost ranks and replacing only them: the supervisor side of `restart_rank`.

`check_hangs` runs in the supervisor's loop while the job is running: when
to ping whom, and whom the answers name hung or dead, is decided by a pure
machine (`core.hang_check.HangCheck`); this module pings, asks the node
agents and looks at the nodes for it. A rank it names becomes a `rank_hang`
/ `rank_dead` anomaly (source `supervisor`) for the policy like any other.
The lost rank leaves the targets of pending commands at once
(`Controller.drop_rank`), so a rollback waiting on it neither deadlocks nor
holds the disruption budget.

When the policy answers `restart_rank`, `start` runs a targeted restart as
a task: kill the lost ranks, start a warm spare (else a new actor) as each
of them in the next generation, order the survivors to regroup from the
lowest healthy rank's state, and wait until every rank has completed a
step in the new generation. A replacement that fails is launched again,
with jittered back-off, into the generation after the failed one over a new
rendezvous store (`WorkerGroup.replace`), up to
`RunSpec.max_targeted_restarts` attempts (0: none); then the job state
machine moves to restarting-all and `_restart_all` kills every rank and
starts the whole group afresh in the next generation, warm spares first,
each rank resuming from the newest durable checkpoint every rank committed
(`committed_steps`; retired checkpoints of an abandoned timeline are never
among them), or from step 0 with the initial state when there is none. If
that fails too, every rank is stopped, the job moves to aborting and the
decision fails (the policy's `on_failure` follows). Each transition is
journaled with its reason; the failed attempts are counted once, by the job
state (`JobState.attempts`).

Where a loss goes is the run's core's to decide (`core.lost_ranks`): a rank
lost while a restart is already decided or under way (two ranks found hung
in one ping round, a survivor that stops during a recovery) joins that
restart, which replaces it too; a lost rank that no decision replaces moves
the job to `degraded`, and a dead one ends the run; a hung one that makes
progress again brings the job back (`check_back`). This module feeds those
findings in (`lost`) and carries out what became of them (`carry_losses`).

What a restart does next is decided by a pure machine, `core.restart.step`
(kill, check the survivors, launch, wait for a step, back off, restart
every rank, resolve); this module carries each effect out (`_carry`) and
feeds back what happened. A restart waits for the group by its own ticks,
fed by the supervisor's report path (`progress`), not by polling the
Controller. The machine's state, the stages' wall times and the restarts
done are the run's core's (its `RestartSection`): this module reads them
from the core and moves them by stepping it (`RestartMoved`), and the state
record written before each effect holds them, so a supervisor that Ray
restarts in the middle of a restart finds where it stood and goes on from
there (`resume`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import structlog

from remedy.control import hang_check, restart
from remedy.control.job import Phase, Regrouped
from remedy.control.lost_ranks import (
    Dropped,
    Joined,
    NotReplaced,
    RankLost,
    RanksMoving,
    ReplacementFailed,
    ToPolicy,
    restart_under_way,
)
from remedy.control.restart import RestartState
from remedy.control.run_core import RestartMoved
from remedy.control.sections import RestartSection
from remedy.policies import Decision
from remedy.protocol import phases
from remedy.protocol.exceptions import SupervisorError
from remedy.protocol.phases import JOINING, RECOVERING
from remedy.protocol.spec import NAMESPACE
from remedy.rank.state.checkpoint_store import checkpoint_tick, committed_steps
from remedy.supervisor import placement, waits
from remedy.supervisor.agent.actor import agent_name

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from remedy.control.decide import Controller
    from remedy.control.hang_watch import HangWatch
    from remedy.control.job import JobStateMachine
    from remedy.control.lost_ranks import LostRanks
    from remedy.control.run_core import Effect, Input, RunCore
    from remedy.control.sightings import Sightings
    from remedy.control.slots import RankSlots
    from remedy.protocol.spec import RunSpec
    from remedy.rundir.writer import RunDir
    from remedy.supervisor.node_watch import DeadNode
    from remedy.supervisor.worker_group import WorkerGroup

log = structlog.get_logger("remedy.recovery")

# A replaced rank and its peers must each complete a step in the new generation within
# this long of the launch (`core.restart`, which keeps the deadline in the state record).
REGROUP_TIMEOUT_S = restart.REGROUP_TIMEOUT_S
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
# How long an agent asked to ping its ranks may take beyond the ping's own timeout.
AGENT_ASK_S = 1.0


# The effects of an attempt: any error carrying one out is one failed attempt.
ATTEMPT_EFFECTS = (
    restart.Kill,
    restart.CheckSurvivors,
    restart.Launch,
    restart.AwaitSteps,
    restart.CheckFormed,
)


def _ranks_text(ranks: set[int]) -> str:
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


class RestartError(SupervisorError):
    """A targeted restart did not bring the group back; the message says why."""


class Recovery:
    """Hang checks and targeted restarts for one supervisor."""

    def __init__(
        self,
        group: WorkerGroup,
        *,
        spec: RunSpec,
        run_dir: RunDir,
        controller: Controller,
        job: JobStateMachine,
        slots: RankSlots,
        watch: HangWatch,
        sightings: Sightings,
        step: Callable[[Input], list[Effect]],
        core: RunCore,
        write_state: Callable[[], None],
        crash_point: Callable[[str], None],
        check_nodes: Callable[..., Awaitable[None]],
    ) -> None:
        """The parts of the supervisor a recovery reads and moves, and what it asks of the
        supervisor: the run's core to step with a loss or a move of the restart (`step`) and
        to read its losses and restart from (`core`), a state record now, a chaos crash
        point, a look at the nodes."""
        self.group = group
        self.spec = spec
        self.run_dir = run_dir
        self.controller = controller
        self.job = job
        self.slots = slots
        self.watch = watch
        self.sightings = sightings
        self.step = step
        self.core = core
        self.write_state = write_state
        self.crash_point = crash_point
        self.check_nodes = check_nodes
        self._failed: dict[int, str] = {}  # replacement rank -> why it failed
        # When to ping whom, and whom the answers name (`core.hang_check`).
        self.hang_check = hang_check.HangCheck(
            watch, sightings, slots.incarnations, agents=spec.node_agents == "on"
        )
        self._task: asyncio.Task[None] | None = None
        if core.restart is None:  # a new run: no restart yet (a restarted one's is restored)
            self.step(RestartMoved(RestartSection()))
        # While a restart waits for the group to step: each rank's newest tick, fed by
        # the supervisor's report path (`progress`), which wakes the waiting restart.
        self._ticks: dict[int, int] = {}
        self._moved = asyncio.Event()

    # ------------------------------------------------------------- detection
    async def check_hangs(self) -> None:
        """A look for hung and dead ranks (`HangCheck`): its pings, asks and node checks carried
        out, each answer stepped back in, until the look is over."""
        check = self.hang_check
        effects = check.step(
            hang_check.Look(time.monotonic(), time.time(), tuple(self.group.actors))
        )
        while effects:
            [effect] = effects
            match effect:
                case hang_check.AskAgents(ranks):
                    await self._ask_agents(list(ranks))
                    effects = check.step(hang_check.Asked(time.monotonic()))
                case hang_check.Ping(ranks):
                    cfg = self.watch.config
                    pings = await self.group.ping_all(
                        cfg.ping_timeout_s,
                        None if ranks is None else [r for r in ranks if r in self.group.actors],
                        patience=cfg.ping_patience,
                    )
                    effects = check.step(hang_check.Pinged(pings, time.monotonic()))
                case hang_check.Found(losses):
                    # Their node may be what died: its loss is reported first, for all its
                    # ranks at once, and their own losses are then parts of it (reported once).
                    await self.check_nodes(self.group, now=True)
                    for f in losses:
                        self.lost(f.rank, f.kind, f.reason, details=dict(f.details or {}),
                                  incarnation=f.incarnation)  # fmt: skip
                    effects = check.step(hang_check.Reported())

    def alarm(self, rank: int) -> None:
        """`rank` said its collective failed: the next look judges every rank now
        (`HangCheck.alarm`).

        A peer whose process or node is gone fails its group's collectives at
        once, and the survivors say so in the report they send before waiting
        for an order. Its silence would take the hang watch's timeout (`floor_s`,
        0.5 s at least) and the ping round that confirms it; the alarm starts that
        round now. A restart under way has its own checks: an alarm then is left.
        """
        if restart_under_way(self.controller, self.job):
            return
        if self.hang_check.alarm(rank, time.monotonic(), time.time()):
            log.info("collective_failed_alarm", rank=rank)

    def _incarnation(self, rank: int) -> int:
        slot = self.slots.slots.get(rank)
        return slot.incarnation if slot is not None else -1

    async def _ask_agents(self, ranks: list[int]) -> None:
        """The agents of `ranks`' nodes ping their ranks now; their sightings are taken.

        One call per node, all at once, waited for together; an agent that does
        not answer in time (its node lost, say) is logged and left out.
        """
        nodes = {self.slots.slots[r].node for r in ranks if r in self.slots.slots}
        calls: dict[Any, str] = {}
        for node in sorted(n for n in nodes if n):
            with contextlib.suppress(ValueError):
                agent = ray.get_actor(agent_name(self.spec.run_id, node), NAMESPACE)
                calls[asyncio.ensure_future(agent.ping_ranks.remote(self.spec.token))] = node
        if not calls:
            return
        cfg = self.watch.config
        wait_s = AGENT_ASK_S + cfg.ping_timeout_s * max(1.0, cfg.ping_patience)
        done, pending = await asyncio.wait(calls, timeout=wait_s)
        for fut in pending:
            fut.cancel()
            log.warning("agent_did_not_answer", node=calls[fut], waited_s=wait_s)
        for fut in done:
            try:
                items = fut.result()  # done: taken from `done`
            except ray.exceptions.RayError as exc:
                log.warning("agent_did_not_answer", node=calls[fut], error=str(exc)[:200])
                continue
            self.sightings.add(calls[fut][:12], items, time.monotonic())

    def nodes_lost(self, dead: list[DeadNode]) -> None:
        """Nodes Ray calls dead: every rank on them is lost at once, journaled with the node.

        The first of a node's ranks goes to the policy as `node_lost`; the others,
        lost in the same instant, join the restart it decides (`LostRanks`), so one
        restart replaces them all, on the surviving nodes (`WorkerGroup.dead_nodes`).
        """
        for node in dead:
            self.group.node_died(node.node_id)
            # Its ranks not yet replaced, and those found lost on their own in the last
            # `lost_ranks.NODE_LOSS_WINDOW_S` (before Ray's verdict on the node; replaced already, perhaps).
            earlier = self.lost_ranks.losses.earlier(node.node_id, time.time())
            current = self.slots.on_node(node.node_id, lost_too=True)
            ranks = sorted({*current, *earlier})
            name = placement.label(node.node_id, node.ip)
            reason = (
                f"node {name} is lost: Ray's GCS lists it dead ({node.reason}); "
                f"{_ranks_text(set(ranks)) if ranks else 'no rank'} ran on it"
            )
            self.run_dir.history({
                "type": "node_lost", "node": name, "node_id": node.node_id, "ranks": ranks,
                "reason": reason, "detected_at": round(time.time(), 4),
            })  # fmt: skip
            log.warning("node_lost", node=name, ranks=ranks, reason=node.reason)
            for rank in current:  # a replaced rank's new process is elsewhere, and fine
                self.lost(rank, "node_lost", reason, details={
                    "node": name, "node_id": node.node_id, "node_ranks": ranks,
                })  # fmt: skip

    def silent_nodes(self) -> set[str]:
        """Nodes every rank of which was found lost in the last `lost_ranks.NODE_LOSS_WINDOW_S`: what a
        node's death looks like before Ray's verdict on it (a peer's failed collective finds
        its ranks gone in well under a second; the GCS takes its health-check time)."""
        return self.lost_ranks.losses.silent_nodes(time.time())

    @property
    def lost_ranks(self) -> LostRanks:
        """The run's core's record of losses (`core.lost_ranks`): changed by stepping the core
        with a loss, and by a restart taking in the ranks it replaces."""
        return self.core.lost

    # The restart's section of the run's record is the core's: read from it, moved by
    # stepping it (`RestartMoved`).
    @property
    def _section(self) -> RestartSection:
        return self.core.restart or RestartSection()

    @property
    def _machine(self) -> RestartState | None:
        """The restart in progress (`control.restart`), with its deadline."""
        return self._section.machine

    @property
    def _marks(self) -> Mapping[str, float]:
        """Wall times of the restart in progress, by stage."""
        return self._section.marks

    @property
    def records(self) -> list[Mapping[str, Any]]:
        """One per restart done, for the summary and benchmarks."""
        return list(self._section.records)

    def _move(self, **changes: Any) -> None:
        self.step(RestartMoved(replace(self._section, **changes)))

    def _mark(self, stage: str) -> None:
        self._move(marks={**self._marks, stage: time.time()})

    def lost(
        self,
        rank: int,
        kind: str,
        reason: str,
        *,
        details: dict[str, Any] | None = None,
        incarnation: int | None = None,
    ) -> None:
        """`rank` (its current incarnation) was found lost: to the run's core, which decides
        where the loss goes (`LostRanks`); what it decided is carried out here.

        `incarnation`: the one the evidence is about; evidence about a process
        already replaced (a ping round that was out while a node's loss replaced
        its ranks) is about nothing running now, and is dropped.
        """
        self.carry_losses(
            self.step(RankLost(rank, kind, reason, time.time(), details or {}, incarnation))
        )

    def carry_losses(self, effects: list[Effect]) -> None:
        """Carry out what became of losses (`core.lost_ranks`); other effects are left."""
        for effect in effects:
            match effect:
                case Dropped(rank, kind, incarnation, current):
                    log.info("loss_of_a_replaced_process", rank=rank, kind=kind,
                             incarnation=incarnation, current=current)  # fmt: skip
                case ReplacementFailed(rank, why):
                    self.replacement_failed(rank, why)
                case Joined(rank, kind, why):
                    log.warning(kind, rank=rank, reason=why)
                    self.write_state()
                    self._moved.set()  # an attempt waiting on the group starts over with it
                case ToPolicy(rank, kind, reason, at):
                    # The restart's timeline, if the policy restarts it: from the first
                    # suspicion and the ping round that confirmed it.
                    self._move(
                        marks={
                            "suspected": self.hang_check.suspected_at or at,
                            "pinged": self.hang_check.ping_started or at,
                        }
                    )
                    log.warning(kind, rank=rank, reason=reason)
                case NotReplaced(rank, why, ending):
                    log.warning("rank_not_replaced", rank=rank, reason=why)
                    if ending:
                        self.group.kill_all()

    def running(self) -> bool:
        """A restart is being carried out: the run goes on while it does, even with no rank's
        process left (a node that held every rank was lost; the restart starts them anew)."""
        return self._task is not None and not self._task.done()

    def _take_joining(self) -> dict[int, str]:
        """The ranks that joined the restart (still in the group), with why; taken."""
        joined = self.lost_ranks.take_joining()
        return {r: why for r, why in joined.items() if r in self.slots.slots}

    def check_back(self) -> None:
        """Lost ranks that nothing replaced and that made progress since: the job runs again."""
        if self.job.state.phase is not Phase.DEGRADED:
            return
        suspects = frozenset(self.watch.suspects(time.monotonic()))
        self.step(RanksMoving(suspects, frozenset(self.group.actors)))

    def replacement_failed(self, rank: int, why: str) -> None:
        if self.lost_ranks.replacing(rank, self.job):
            self._failed[rank] = why
            self._moved.set()

    def progress(self, rank: int, tick: int) -> None:
        """A report of `rank` at `tick` was accepted: a restart waiting on the group learns it."""
        if rank in self._ticks:
            self._ticks[rank] = tick
            self._moved.set()

    async def _until_stepped(
        self,
        world: list[int],
        past: int,
        replaced: list[int],
        *,
        fresh: bool = False,
        deadline: float = 0.0,
    ) -> None:
        """Wait until every rank of `world` reported a tick past `past` (a step of the new generation).

        Woken by `progress` and `replacement_failed`, not by polling. Raises
        `RestartError` when a rank of `replaced` failed, or at wall time `deadline`
        (the launch's, from the state record; 0: `REGROUP_TIMEOUT_S` from now).
        """
        if fresh:  # no tick seen yet in this supervisor's life
            self._ticks = dict.fromkeys(world, -1)
        deadline = deadline or time.time() + REGROUP_TIMEOUT_S
        while not all(self._ticks.get(r, -1) > past for r in world):
            if self.lost_ranks.joining:
                raise RestartError(
                    f"{_ranks_text(set(self.lost_ranks.joining))} lost while the group re-formed"
                )
            failed = {r: why for r, why in self._failed.items() if r in replaced}
            if failed:
                raise RestartError(
                    "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
                )
            left = deadline - time.time()
            if left <= 0:
                raise RestartError(
                    f"the group did not step within {REGROUP_TIMEOUT_S:g}s of the launch "
                    f"({await self._where_they_are(world)})"
                )
            self._moved.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), timeout=left)
        self._ticks = {}

    # --------------------------------------------------------------- restart
    def start(self, d: Decision) -> None:
        """Begin a targeted restart of `d.ranks`; the decision resolves when it ends."""
        self._task = asyncio.get_running_loop().create_task(self._restart(d))

    async def settle(self, results: dict[int, dict[str, Any]]) -> None:
        """Every rank has ended: end a restart still waiting on the group.

        A restart whose group re-formed and finished while the supervisor was
        away (restarted after its crash) never sees the step it waits for:
        when every rank's current incarnation completed, it worked.
        """
        if self._task is None or self._task.done():
            return
        self._task.cancel()
        restarts = [d for d in self.controller.deferred.values() if d.action == "restart_rank"]
        completed = len(results) == self.spec.workers and all(
            r.get("status") == "completed" and r.get("incarnation") == self.slots.incarnation(rank)
            for rank, r in results.items()
        )
        if not (
            restarts
            and completed
            and self.job.state.phase in (Phase.RECOVERING, Phase.RESTARTING_ALL)
        ):
            return
        launched = (self._machine.launched if self._machine else None) or {}
        generation = int(launched.get("generation", self.group.generation))
        self.job.step(Regrouped(generation, "every rank finished in it"))
        for d in restarts:
            self.controller.resolve_group_action(
                d.decision_id,
                "applied",
                f"generation {generation} formed and every rank of it completed the run",
                result={"generation": generation, "ranks": list(d.ranks)},
            )
        self._move(machine=None)

    # ---------------------------------------------------------- after a crash
    def resume(self, d: Decision) -> None:
        """Carry on restart `d`, which a supervisor that crashed left in progress."""
        log.warning("restart_resumed", decision=d.decision_id, phase=self.job.state.phase,
                    stage=self._machine.stage if self._machine else None)  # fmt: skip
        self._task = asyncio.get_running_loop().create_task(self._restart(d, resumed=True))

    # --------------------------------------------------------------- restart
    async def _restart(self, d: Decision, *, resumed: bool = False) -> None:
        """Carry out restart `d`: what comes next is `core.restart.step`'s to say.

        Each effect is preceded by a state record holding the machine's state: a
        supervisor killed at any point finds the decision deferred and where the
        restart stood, and goes on (`Resume`).
        """
        joined = self._take_joining()
        ranks = tuple(sorted({*(r for r in d.ranks if r in self.slots.slots), *joined}))
        why = "; ".join([f"{d.anomaly.kind} on rank {d.anomaly.rank}", *joined.values()])
        machine = self._machine
        if not (resumed and machine is not None and machine.decision_id in ("", d.decision_id)):
            machine = RestartState(d.decision_id, self.spec.workers)
        machine = replace(machine, decision_id=d.decision_id)
        inp: restart.RestartInput = (
            restart.Resume(ranks, why) if resumed else restart.Begin(ranks, why)
        )
        if "restart" not in self._marks:
            self._mark("restart")
        while True:
            machine, effects = restart.step(
                machine,
                self.job.state,
                inp,
                cause=d.anomaly.kind,
                max_targeted=self.job.max_targeted,
            )
            self._move(machine=machine)
            for effect in effects:
                if isinstance(effect, restart.Job):
                    self.job.step(effect.input)
            self.write_state()
            outcome = [e for e in effects if not isinstance(e, restart.Job)]
            if not outcome:
                raise RestartError(f"the restart machine gave nothing to do for {inp!r}")
            *rest, last = outcome
            for effect in rest:  # only KillAll comes before the last
                await self._carry(d, machine, effect)
            try:
                answer = await self._carry(d, machine, last)
            except Exception as exc:  # any failure of an attempt is one failed attempt
                if not isinstance(last, ATTEMPT_EFFECTS):
                    raise
                answer = restart.AttemptFailed(str(exc))
            if answer is None:  # resolved: the restart is over
                self._move(machine=None)
                return
            inp = answer

    async def _carry(
        self, d: Decision, machine: RestartState, effect: restart.Effect
    ) -> restart.RestartInput | None:
        """Carry one effect out; what happened, as the machine's next input (None: resolved)."""
        c = self.controller
        world = list(range(self.spec.workers))
        match effect:
            case restart.Kill(ranks, live):
                self._replacing_now(ranks)
                front = max(c.tick_of.get(r, 0) for r in live)
                for r in ranks:
                    self.group.kill(r)
                if machine.first:  # the record's timeline: the first attempt's
                    self._mark("killed")
                self.crash_point("restart_rank:killed")
                if self.spec.gpus_per_rank:
                    # NCCL kernels keep spinning after a peer dies: abort the survivors'
                    # communicators from their control threads (a no-op on gloo ranks).
                    await waits.within(
                        asyncio.gather(*(self.group.actors[r].abort.remote() for r in live)),
                        ABORT_S,
                        "the survivors' communicator aborts",
                    )
                return restart.Killed(front)
            case restart.CheckSurvivors(live, retry):
                if retry:  # its waits on the failed generation's store fail now
                    self.group.abandon_generation()
                return await self._check_survivors(list(live), first=not retry)
            case restart.Launch(ranks, source, retry):
                info = await self.group.replace(list(ranks), source=source, retry=retry)
                if not retry:
                    self._mark("launched")
                return restart.Launched(info, time.time())
            case restart.AwaitSteps(past, ranks, live, fresh, deadline):
                if machine.first and not fresh:
                    # After the state record of the new incarnations, spares and generation.
                    self.crash_point("restart_rank:launched")
                if fresh:  # after a resume: the crashed supervisor's launch, and its deadline
                    await self._until_stepped(
                        world, past, list(ranks), fresh=True, deadline=deadline
                    )
                    return restart.Stepped()
                now = time.monotonic()
                for r in ranks:
                    self.watch.started(r, now)
                for r in live:
                    self.watch.allow(r, REGROUP_TIMEOUT_S, now)
                await self._until_stepped(world, past, list(ranks), deadline=deadline)
                # Back to step-time timeouts: a second hang is found as fast.
                for r in world:
                    self.watch.settle(r)
                return restart.Stepped()
            case restart.CheckFormed(generation):
                return restart.Formed(await self._formed(generation))
            case restart.Backoff(attempts):
                # Jittered exponential back-off before the next attempt (at most 1 s).
                await asyncio.sleep(random.uniform(0, min(1.0, 0.05 * 2**attempts)))
                return restart.Waited(tuple(sorted(self._take_joining())))
            case restart.RestartAll(cause):
                try:
                    info = await self._restart_all(cause)
                except RestartError as exc:
                    return restart.AllFailed(str(exc))
                finally:
                    self.lost_ranks.started_all()
                return restart.AllRestarted(info)
            case restart.KillAll():
                self.group.kill_all()  # nothing left to supervise: the run ends
                return None
            case restart.Resolve(outcome, detail, ranks, info):
                if outcome == "applied" and info is not None:
                    detected = self.lost_ranks.detected_at
                    t_detect = min(detected.get(r, time.time()) for r in ranks)
                    await self._applied(d, info, list(ranks), t_detect, detail)
                else:
                    c.resolve_group_action(d.decision_id, outcome, detail)
                return None
        raise RestartError(f"unknown effect {effect!r}")

    def _replacing_now(self, ranks: tuple[int, ...]) -> None:
        """An attempt begins for `ranks`: their slots close, and the ticks the group must pass
        are fed by reports from here on (the old processes report nothing that counts)."""
        for r in ranks:
            self._failed.pop(r, None)
            self.slots.lose(r)
        tick_of = self.controller.tick_of
        self._ticks = {
            r: -1 if r in ranks else tick_of.get(r, -1) for r in range(self.spec.workers)
        }

    async def _check_survivors(self, live: list[int], *, first: bool) -> restart.Checked:
        """Survivors still blocked in the broken collective or stuck in a rendezvous, and ranks
        lost meanwhile: all killed."""
        blocked, stuck, framework = await self._blocked(live)
        if first:
            self._mark("survivors_checked")
        # Lost while this attempt waited on the survivors (the rest of a lost node's
        # ranks, found by Ray's verdict on the node): replaced with the others, now.
        joined = sorted(self.lost_ranks.take_joining(live))
        for r in joined:
            self._ticks[r] = -1
            self.slots.lose(r)
            self.group.kill(r)
        blocked = [r for r in blocked if r not in joined]
        stuck = [r for r in stuck if r not in joined]
        framework = [r for r in framework if r not in joined]
        # gloo: a survivor waiting on a peer that itself left the collective (not on the
        # killed rank) stays blocked until that peer's process exits, and one waiting in a
        # rendezvous for a peer that died there waits for good; each is replaced too, from
        # a survivor that did recover.
        for r in (*blocked, *stuck, *framework):
            self._ticks[r] = -1
            self.lost_ranks.losses.mark(r, self.slots.incarnation(r))
            self.slots.lose(r)
            self.controller.drop_rank(r)
            self.group.kill(r)
        return restart.Checked(tuple(blocked), tuple(joined), tuple(stuck), tuple(framework))

    async def _applied(
        self, d: Decision, info: dict[str, Any], ranks: list[int], t_detect: float, what: str
    ) -> None:
        """Record a restart that worked and resolve its decision `applied`."""
        t_stepped = time.time()
        pings = await self.group.ping_all(self.watch.config.ping_timeout_s)
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
        self._move(records=(*self._section.records, record))
        self.controller.resolve_group_action(
            d.decision_id,
            "applied",
            f"{what}; every rank stepped {record['detect_to_step_s']:.2f}s after detection",
            result=record,
        )
        self.group.refill_spares()

    # ------------------------------------------------------ full-group restart
    async def _restart_all(self, cause: str) -> dict[str, Any]:
        """Kill every rank, start them all in a new generation from the last committed checkpoint.

        `cause`: the anomaly that led here; the steps the group redoes are lost to it.
        """
        c = self.controller
        world = list(range(self.spec.workers))
        directory = Path(self.spec.run_dir) / "checkpoints"
        steps = committed_steps(directory, self.spec.workers)
        resume = steps[-1] if steps else None
        # The steps redone: from the checkpoint to the furthest step a rank reported.
        reached = max((s for r, s in c.last_steps().items() if r in world), default=0)
        lead_executed = await self._lead_executed()
        if resume is None:
            resumed = "from step 0 with the initial state: no checkpoint is committed by every rank"
            floor = 0
        else:
            resumed = (
                f"from checkpoint step {resume}, the newest of the steps every rank "
                f"committed: {', '.join(map(str, steps))}"
            )
            floor = checkpoint_tick(directory, resume) or 0
        self.lost_ranks.starting_all(world, self.slots)
        self._failed.clear()
        for r in world:
            self.slots.lose(r)  # from here a report of the killed processes is refused
        self.run_dir.history({
            "type": "full_restart", "resume_step": resume, "committed_steps": steps,
            "reached_step": reached, "lead_executed": lead_executed,
            "reason": f"restarting every rank {resumed}", "cause": cause,
        })  # fmt: skip
        now = time.time()
        c.goodput.restarting(now, cause)
        if lead_executed is not None:
            c.goodput.expect_reach(now, lead_executed)
        self._ticks = dict.fromkeys(world, -1)  # before the launch: no report is missed
        info = await self.group.restart_all(resume)
        # What was decided on the steps run again is settled by running them again.
        c.rewound(floor, "from step 0" if resume is None else f"from checkpoint step {resume}")
        self._reissue_pending()
        self.write_state()
        self.crash_point("restart_all:launched")
        now = time.monotonic()
        for r in world:
            c.forget_rank(r)
            self.watch.started(r, now)
        # Each rank reports once when its Guard exists (tick 0), then resumes at the
        # checkpoint's tick: a tick past it is a step completed in the new generation.
        await self._until_stepped(world, floor, world)
        return {
            **info,
            "resumed": resumed,
            "reached_step": reached,
            "steps_lost": max(reached - (resume or 0), 0),
        }

    async def _lead_executed(self) -> int | None:
        """How many steps the goodput ledger's lead rank had executed, by its ping, before a
        full-group restart kills it: a rank in a broken collective may not have reported
        its last steps, which were executed all the same (`GoodputLedger.expect_reach`).
        None when it is gone or silent (bounded by the ping timeout)."""
        lead = self.controller.goodput.lead
        if lead not in self.group.actors:
            return None
        answer = (await self.group.ping_all(self.watch.config.ping_timeout_s, ranks=[lead]))[lead]
        step = answer.get("step") if isinstance(answer, dict) else None
        return step if type(step) is int and step >= 0 else None

    async def _where_they_are(self, ranks: list[int]) -> str:
        """Each rank's phase and generation as its ping tells them, for a restart that timed out."""
        present = [r for r in ranks if r in self.group.actors]
        pings = await self.group.ping_all(self.watch.config.ping_timeout_s, ranks=present)
        return ", ".join(
            f"rank {r}: {p.get('phase')} in generation {p.get('generation')} at tick {p.get('tick')}"
            if isinstance(p, dict)
            else f"rank {r}: {p}"
            for r, p in sorted(pings.items())
        )

    def _reissue_pending(self) -> None:
        """Every rank of the new generation gets every pending command again.

        The ranks resume from a checkpoint older than any answer the old
        processes gave, so an answer from before the restart does not count:
        a command applied by some of the old ranks is applied by all new ones.
        """
        world = set(range(self.spec.workers))
        for pending in self.controller.pending.values():
            pending.outcomes.clear()
            pending.dropped.clear()
            pending.targets = set(world)

    async def _blocked(self, live: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Survivors that have not caught the broken collective's error after a grace period;
        those still joining a generation: no generation is being formed now (the ranks
        it needed were just killed, or it was abandoned), so one still in its rendezvous
        after the grace waits there for a peer that is gone (`phases.JOINING`); and those
        under a framework's loop, which never re-form the group (`phases.regroups`), at
        once."""
        grace = max(BLOCKED_GRACE_S, *(3 * self.watch.p99(r) for r in live))
        deadline = time.monotonic() + grace
        while True:
            # A survivor that joined the restart meanwhile (its node found lost) is not waited on.
            live = [r for r in live if r not in self.lost_ranks.joining]
            if not live:
                return [], [], []
            pings = await self.group.ping_all(self.watch.config.ping_timeout_s, ranks=live)
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
            if not waiting or time.monotonic() > deadline + extra:
                stuck = [r for r in still if phases.of(pings[r]) == JOINING]
                framework = [r for r in still if r not in waiting and r not in stuck]
                blocked = [r for r in still if r not in stuck and r not in framework]
                return blocked, stuck, framework
            await asyncio.sleep(0.02)

    async def _formed(self, generation: int) -> bool:
        """True if every rank answers from `generation`: the crashed supervisor's restart took."""
        pings = await self.group.ping_all(
            self.watch.config.ping_timeout_s, patience=self.watch.config.ping_patience
        )
        every = range(self.spec.workers)
        # A rank still joining it has not formed it (and may never: `phases.JOINING`).
        return all(
            r in pings
            and isinstance(pings[r], dict)
            and pings[r].get("generation") == generation
            and phases.of(pings[r]) != JOINING
            for r in every
        )
