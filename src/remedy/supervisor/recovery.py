"""Finding lost ranks and replacing only them: the supervisor side of `restart_rank`.

`check_hangs` runs in the supervisor's loop while the job is running: when
to ping whom, and whom the answers name hung or dead, is decided by a pure
machine (`core.hang_check.HangCheck`); `supervisor.loss_finder` pings, asks
the node agents and looks at the nodes for it. A rank it names becomes a
`rank_hang` / `rank_dead` anomaly (source `supervisor`) for the policy like
any other.
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
every rank, resolve); this module feeds it inputs and carries each effect
out (`_carry`, with the I/O in `supervisor.restart_carry`, each step of it
returning the machine's next input). A restart waits for the group by its
own ticks, fed by the supervisor's report path (`progress`), not by polling
the Controller (`supervisor.step_wait`). The machine's state, the stages'
wall times and the restarts done are the run's core's (its
`RestartSection`): this module reads them from the core and moves them by
stepping it (`RestartMoved`), and the state record written before each
effect holds them, so a supervisor that Ray restarts in the middle of a
restart finds where it stood and goes on from there (`resume`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import structlog

from remedy.control import restart
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
from remedy.supervisor import restart_carry as carry
from remedy.supervisor.loss_finder import LossFinder
from remedy.supervisor.step_wait import REGROUP_TIMEOUT_S, GroupSteps, RestartError

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


# The effects of an attempt: any error carrying one out is one failed attempt.
ATTEMPT_EFFECTS = (
    restart.Kill,
    restart.CheckSurvivors,
    restart.Launch,
    restart.AwaitSteps,
    restart.CheckFormed,
)


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
        # Finding lost ranks: hang checks, agents' sightings, dead nodes.
        self.finder = LossFinder(
            group, spec=spec, run_dir=run_dir, slots=slots, watch=watch, sightings=sightings,
            core=core, check_nodes=check_nodes, lost=self.lost,
        )  # fmt: skip
        self.hang_check = self.finder.hang_check
        self._task: asyncio.Task[None] | None = None
        if core.restart is None:  # a new run: no restart yet (a restarted one's is restored)
            self.step(RestartMoved(RestartSection()))
        # While a restart waits for the group to step: each rank's newest tick, fed by
        # the supervisor's report path (`progress`), which wakes the waiting restart.
        self.steps = GroupSteps()

    # ------------------------------------------------------------- detection
    async def check_hangs(self) -> None:
        """A look for hung and dead ranks (`LossFinder.check_hangs`)."""
        await self.finder.check_hangs()

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

    def nodes_lost(self, dead: list[DeadNode]) -> None:
        """Nodes Ray calls dead: every rank on them is lost at once (`LossFinder.nodes_lost`)."""
        self.finder.nodes_lost(dead)

    def silent_nodes(self) -> set[str]:
        """Nodes whose every rank was found lost just now (`LossFinder.silent_nodes`)."""
        return self.finder.silent_nodes()

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
                    self.steps.wake()  # an attempt waiting on the group starts over with it
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
            self.steps.fail(rank, why)

    def progress(self, rank: int, tick: int) -> None:
        """A report of `rank` at `tick` was accepted: a restart waiting on the group learns it."""
        self.steps.progress(rank, tick)

    async def _until_stepped(
        self, world: list[int], past: int, replaced: list[int], **how: Any
    ) -> None:
        """Wait until every rank of `world` stepped past tick `past` (`GroupSteps`)."""
        timeout_s = self.watch.config.ping_timeout_s
        await self.steps.until_stepped(
            world, past, replaced, joining=lambda: self.lost_ranks.joining,
            where=lambda: carry.where_they_are(self.group, world, timeout_s),
            own_phase=lambda behind: carry.phase_left(self.group, behind, timeout_s), **how,
        )  # fmt: skip

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
        """Carry one effect out (`restart_carry`); what happened, as the machine's next input
        (None: resolved)."""
        world = list(range(self.spec.workers))
        match effect:
            case restart.Kill(ranks, live):
                self._replacing_now(ranks)
                front = max(self.controller.tick_of.get(r, 0) for r in live)
                killed = carry.kill(self.group, ranks, front)
                if machine.first:  # the record's timeline: the first attempt's
                    self._mark("killed")
                self.crash_point("restart_rank:killed")
                if self.spec.gpus_per_rank:
                    await carry.abort_collectives(self.group, live)
                return killed
            case restart.CheckSurvivors(live, retry):
                if retry:  # its waits on the failed generation's store fail now
                    self.group.abandon_generation()
                return await self._check_survivors(list(live), first=not retry)
            case restart.Launch(ranks, source, retry):
                launched = await carry.launch(self.group, ranks, source, retry=retry)
                if not retry:
                    self._mark("launched")
                return launched
            case restart.AwaitSteps(past, ranks, live, fresh, deadline):
                if machine.first and not fresh:
                    # After the state record of the new incarnations, spares and generation.
                    self.crash_point("restart_rank:launched")
                if fresh:  # after a resume: the crashed supervisor's launch, and its deadline
                    await self._until_stepped(world, past, list(ranks), fresh=True,
                                              deadline=deadline)  # fmt: skip
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
                return await carry.backoff(attempts, self._take_joining)
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
                    self.controller.resolve_group_action(d.decision_id, outcome, detail)
                return None
        raise RestartError(f"unknown effect {effect!r}")

    def _replacing_now(self, ranks: tuple[int, ...]) -> None:
        """An attempt begins for `ranks`: their slots close, and the ticks the group must pass
        are fed by reports from here on (the old processes report nothing that counts)."""
        for r in ranks:
            self.steps.failed.pop(r, None)
            self.slots.lose(r)
        tick_of = self.controller.tick_of
        self.steps.ticks = {
            r: -1 if r in ranks else tick_of.get(r, -1) for r in range(self.spec.workers)
        }

    async def _check_survivors(self, live: list[int], *, first: bool) -> restart.Checked:
        """Survivors still blocked in the broken collective or stuck in a rendezvous, and ranks
        lost meanwhile: all killed."""
        found = await carry.blocked_survivors(
            self.group, live, joining=lambda: self.lost_ranks.joining,
            grace_s=max(carry.BLOCKED_GRACE_S, *(3 * self.watch.p99(r) for r in live)),
            ping_timeout_s=self.watch.config.ping_timeout_s,
        )  # fmt: skip
        if first:
            self._mark("survivors_checked")
        # Lost while this attempt waited on the survivors (the rest of a lost node's
        # ranks, found by Ray's verdict on the node): replaced with the others, now.
        joined = tuple(sorted(self.lost_ranks.take_joining(live)))
        for r in joined:
            self.steps.ticks[r] = -1
            self.slots.lose(r)
            self.group.kill(r)
        blocked, stuck, framework = (
            tuple(r for r in found_ if r not in joined)
            for found_ in (found.blocked, found.stuck, found.framework)
        )
        # gloo: a survivor waiting on a peer that itself left the collective (not on the
        # killed rank) stays blocked until that peer's process exits, and one waiting in a
        # rendezvous for a peer that died there waits for good; each is replaced too, from
        # a survivor that did recover.
        for r in (*blocked, *stuck, *framework):
            self.steps.ticks[r] = -1
            self.lost_ranks.losses.mark(r, self.slots.incarnation(r))
            self.slots.lose(r)
            self.controller.drop_rank(r)
            self.group.kill(r)
        return restart.Checked(blocked, joined, stuck, framework)

    async def _applied(
        self, d: Decision, info: dict[str, Any], ranks: list[int], t_detect: float, what: str
    ) -> None:
        """Record a restart that worked and resolve its decision `applied`."""
        record = await carry.restart_record(
            self.group, d, info, ranks, detected=t_detect, marks=self._marks,
            ping_timeout_s=self.watch.config.ping_timeout_s,
        )  # fmt: skip
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
        at = carry.ResumePoint.of(self.spec.run_dir, self.spec.workers)
        # The steps redone: from the checkpoint to the furthest step a rank reported.
        reached = max((s for r, s in c.last_steps().items() if r in world), default=0)
        lead_executed = await carry.lead_executed(
            self.group, c.goodput.lead, self.watch.config.ping_timeout_s
        )
        self.lost_ranks.starting_all(world, self.slots)
        self.steps.failed.clear()
        for r in world:
            self.slots.lose(r)  # from here a report of the killed processes is refused
        self.run_dir.history({
            "type": "full_restart", "resume_step": at.step, "committed_steps": at.committed,
            "reached_step": reached, "lead_executed": lead_executed,
            "reason": f"restarting every rank {at.resumed}", "cause": cause,
        })  # fmt: skip
        now = time.time()
        c.goodput.restarting(now, cause)
        if lead_executed is not None:
            c.goodput.expect_reach(now, lead_executed)
        self.steps.ticks = dict.fromkeys(world, -1)  # before the launch: no report is missed
        info = await self.group.restart_all(at.step)
        # What was decided on the steps run again is settled by running them again.
        c.rewound(at.floor, "from step 0" if at.step is None else f"from checkpoint step {at.step}")
        self._reissue_pending()
        self.write_state()
        self.crash_point("restart_all:launched")
        now = time.monotonic()
        for r in world:
            c.forget_rank(r)
            self.watch.started(r, now)
        # Each rank reports once when its Guard exists (tick 0), then resumes at the
        # checkpoint's tick: a tick past it is a step completed in the new generation.
        await self._until_stepped(world, at.floor, world)
        return {
            **info,
            "resumed": at.resumed,
            "reached_step": reached,
            "steps_lost": max(reached - (at.step or 0), 0),
        }

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

    async def _formed(self, generation: int) -> bool:
        """True if every rank answers from `generation`: the crashed supervisor's restart took."""
        cfg = self.watch.config
        return (await carry.formed(self.group, generation, self.spec.workers,
                                   ping_timeout_s=cfg.ping_timeout_s,
                                   patience=cfg.ping_patience)).formed  # fmt: skip
