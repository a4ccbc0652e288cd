"""Lost ranks: where each loss goes, and what the job does about a rank nothing replaces.

A rank is found lost by the hang check (hung, or its process gone), by its
run call raising, or with its node. `LostRanks.step` takes that finding
(`RankLost`) and decides, with the controller, the job's state machine and
the rank slots it is given:

- evidence about a process already replaced is dropped (`Dropped`), and a
  process reported once is not reported again;
- a rank that a restart is starting failed that start (`ReplacementFailed`);
- a rank lost while a restart is decided or under way joins it
  (`Joined`): its anomaly is recorded, the job's lost set grows, and that
  restart replaces it too; a second decision would be cooled down or
  suppressed, and nothing would replace the rank;
- any other goes to the policy as a critical anomaly of source
  `supervisor` (`ToPolicy`). A loss that no decision replaces (the policy
  notified, ran dry, or its restart was suppressed) moves the job to
  `degraded` (`NotReplaced`); a dead rank, or a lost node's, ends the run
  there, since its peers cannot take one more step without it.

Either way the rank leaves the targets of pending commands at once
(`Controller.drop_rank`), so a rollback waiting on it neither deadlocks nor
holds the disruption budget, and the group's time lost is counted from
here (`GoodputLedger.disrupted`). `RanksMoving` brings a degraded job back
when its lost ranks move again (they were slow, not hung).

What it keeps is a part of the supervisor's state record (the `recovery`
section's `detected_at`, `joining` and `losses`): a supervisor that Ray
restarts neither reports a process lost twice nor loses a rank that was
joining a restart. `supervisor.recovery.Recovery` carries the effects out
(logs, the restart's marks, waking a restart waiting on the group, killing
every rank) and takes the joined ranks in (`take_joining`).

No Ray, no torch, no I/O and no clock: wall times are given.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from remedy.control.job import (
    JobStateMachine,
    Phase,
    RanksBack,
    RanksLost,
    RanksUnreplaced,
)
from remedy.control.losses import Losses, Route
from remedy.control.sections import LossesSection
from remedy.policies import AnomalyEvent

if TYPE_CHECKING:
    from remedy.control.decide import Controller
    from remedy.control.slots import RankSlots

# A rank found lost this long before Ray calls its node dead is counted among the
# node's lost ranks (Ray's verdict takes the GCS's health-check time, 15 s by default).
NODE_LOSS_WINDOW_S = 60.0
_UNDER_WAY = (Phase.RECOVERING, Phase.RESTARTING_ALL)
# Losses whose rank cannot come back on its own: nothing replacing it ends the run.
_GONE = ("rank_dead", "node_lost")


# ------------------------------------------------------------------- inputs
@dataclass(frozen=True, slots=True)
class RankLost:
    """`rank` was found lost at wall time `at`: `kind` is `rank_hang`, `rank_dead` or
    `node_lost`; `incarnation` the process the evidence is about (None: the current one)."""

    rank: int
    kind: str
    reason: str
    at: float
    details: Mapping[str, Any] = field(default_factory=dict)
    incarnation: int | None = None


@dataclass(frozen=True, slots=True)
class RanksMoving:
    """The hang watch's suspects now (`suspects`), and the ranks with a process (`running`):
    a lost rank nothing replaced that is in `running` and no longer a suspect is back."""

    suspects: frozenset[int]
    running: frozenset[int]


# ------------------------------------------------------------------ effects
@dataclass(frozen=True, slots=True)
class Dropped:
    """The evidence was about process `incarnation` of `rank`, replaced since by `current`."""

    rank: int
    kind: str
    incarnation: int
    current: int


@dataclass(frozen=True, slots=True)
class ReplacementFailed:
    """`rank`, which a restart is starting, failed: was lost, or its run call failed."""

    rank: int
    why: str


@dataclass(frozen=True, slots=True)
class Joined:
    """`rank` was lost while a restart was decided or under way: that restart replaces it."""

    rank: int
    kind: str
    why: str


@dataclass(frozen=True, slots=True)
class ToPolicy:
    """`rank`'s loss went to the policy as an anomaly, found at `at`."""

    rank: int
    kind: str
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class NotReplaced:
    """No decision replaces lost `rank`: the job is degraded, for `why`; `ending`: the run
    cannot go on without it (every rank is to be stopped)."""

    rank: int
    why: str
    ending: bool


Effect = Dropped | ReplacementFailed | Joined | ToPolicy | NotReplaced


def restart_under_way(controller: Controller, job: JobStateMachine) -> bool:
    """A restart is decided (it may not have begun yet) or running."""
    return job.state.phase in _UNDER_WAY or any(
        d.action == "restart_rank" for d in controller.deferred.values()
    )


@dataclass
class LostRanks:
    """The losses reported and what became of them (see the module docstring)."""

    losses: Losses = field(default_factory=lambda: Losses(NODE_LOSS_WINDOW_S))
    detected_at: dict[int, float] = field(default_factory=dict)  # rank -> when found lost
    # Ranks lost while a restart was under way, with why: that restart takes them in.
    joining: dict[int, str] = field(default_factory=dict)
    restarting: set[int] = field(default_factory=set)  # every rank, while a full restart runs

    # ---------------------------------------------------------------- step
    def step(
        self,
        inp: RankLost | RanksMoving,
        *,
        controller: Controller,
        job: JobStateMachine,
        slots: RankSlots,
    ) -> list[Effect]:
        match inp:
            case RankLost():
                return self._lost(inp, controller, job, slots)
            case RanksMoving(suspects, running):
                self._back(suspects, running, job, slots)
                return []
        raise TypeError(f"not an input of the lost ranks: {inp!r}")

    def _lost(
        self, inp: RankLost, c: Controller, job: JobStateMachine, slots: RankSlots
    ) -> list[Effect]:
        rank, kind = inp.rank, inp.kind
        current = slots.incarnation(rank)
        route = self.losses.route(
            rank, current, inp.incarnation,
            starting=self.replacing(rank, job), under_way=restart_under_way(c, job),
        )  # fmt: skip
        if route is Route.STALE:
            assert inp.incarnation is not None  # STALE: the evidence named another process
            return [Dropped(rank, kind, inp.incarnation, current)]
        if route is Route.REPORTED:
            return []
        node = slots.slots[rank].node
        if node is not None:
            self.losses.on_node(rank, node, slots.on_node(node, lost_too=True), inp.at)
        if route is Route.START_FAILED:
            return [ReplacementFailed(rank, inp.reason)]
        # The slot is closed (its reports refused) only when a restart replaces it:
        # if the policy does not restart it, a slow rank that comes back still counts.
        self.detected_at[rank] = inp.at
        # The group stalls from here until the restart: that time is lost to this loss.
        c.goodput.disrupted(inp.at, kind)
        preempted = c.drop_rank(rank)
        # The step the group is stuck at: a hung rank's own reports may lag behind, and the
        # ping that found it says where the ranks are (`control.stuck_at`).
        step, tick = max(c.step_of.values(), default=0), max(c.tick_of.values(), default=0)
        pinged_step, pinged_tick = inp.details.get("step"), inp.details.get("tick")
        if type(pinged_step) is int and type(pinged_tick) is int and pinged_tick >= tick:
            step, tick = pinged_step, pinged_tick
        if route is Route.JOIN:
            why = f"{inp.reason}; joins the restart under way"
            c.record_anomaly(AnomalyEvent(
                kind=kind, rank=rank, step=step, tick=tick, severity="critical",
                source="supervisor", ts=inp.at,
                details={"reason": why, "incarnation": current, **inp.details},
            ))  # fmt: skip
            self.joining[rank] = f"{kind} on rank {rank}"
            if job.state.phase in _UNDER_WAY:
                job.step(RanksLost(frozenset({rank}), why))
            return [Joined(rank, kind, why)]
        ev = AnomalyEvent(
            kind=kind, rank=rank, step=step, tick=tick, severity="critical",
            source="supervisor", ts=inp.at,
            details={"reason": inp.reason, "incarnation": current, "preempted": preempted,
                     **inp.details},
        )  # fmt: skip
        answered, notifying = len(c.decisions), set(c.notifying)
        c.ingest({"rank": rank, "step": step, "tick": tick, "events": [ev.to_dict()]},
                 now=inp.at, answer=False)  # fmt: skip
        out: list[Effect] = [ToPolicy(rank, kind, inp.reason, inp.at)]
        # A `notify` the shell carries is applied once carried (logged and queued for the
        # sinks; `effects.log_notify`): it answers the loss as a resolved one would.
        sent = [{"rule": d.rule, "action": d.action, "outcome": "applied"}
                for i, d in c.notifying.items() if i not in notifying]  # fmt: skip
        unreplaced = self._unreplaced(inp, c, job, [*c.decisions[answered:], *sent])
        if unreplaced is not None:
            out.append(unreplaced)
        return out

    def _unreplaced(
        self,
        inp: RankLost,
        c: Controller,
        job: JobStateMachine,
        answers: list[dict[str, Any]],
    ) -> NotReplaced | None:
        """A lost rank no decision replaces: the job is degraded; a dead one ends the run.

        The policy may answer a loss with a notification, run dry, or have its
        restart suppressed: then nothing brings the rank back, the other ranks
        wait on it, and the job must not go on saying it is running.
        """
        rank = inp.rank
        if any(d.action == "restart_rank" and rank in d.ranks for d in c.deferred.values()):
            return None
        if job.state.phase not in (Phase.RUNNING, Phase.DEGRADED):
            return None
        said = "; ".join(
            f"rule '{a.get('rule')}' chose {a.get('action')} ({a.get('outcome')})" for a in answers
        )
        why = f"{inp.reason}; not replaced: {said or 'no rule of the policy answered it'}"
        # Its peers cannot take one more step without a dead rank: waiting for them to
        # time out of their regroup wait ends the same way, minutes later.
        ending = inp.kind in _GONE and c.abort_reason is None
        if ending:
            why += "; the run cannot go on without it: ending it"
        job.step(RanksUnreplaced(frozenset({rank}), why))
        return NotReplaced(rank, why, ending)

    def _back(
        self,
        suspects: frozenset[int],
        running: frozenset[int],
        job: JobStateMachine,
        slots: RankSlots,
    ) -> None:
        """Lost ranks that nothing replaced and that made progress since: the job runs again."""
        state = job.state
        if state.phase is not Phase.DEGRADED:
            return
        back = frozenset(r for r in state.lost if r not in suspects and r in running)
        if back:
            for r in back:  # a later hang of the same process is found again
                self.losses.back(r, slots.incarnation(r))
            job.step(RanksBack(back))

    # -------------------------------------------------- the restart's part
    def replacing(self, rank: int, job: JobStateMachine) -> bool:
        """True while `rank` is being started by a restart (targeted or full-group)."""
        state = job.state
        if state.phase is Phase.RECOVERING:
            return rank in state.lost
        return state.phase is Phase.RESTARTING_ALL and rank in self.restarting

    def starting_all(self, ranks: list[int], slots: RankSlots) -> None:
        """A full-group restart starts `ranks` anew: their processes now are accounted for
        (never reported lost), and a loss of one of them while it starts fails that start."""
        self.restarting = set(ranks)
        for r in ranks:
            self.losses.mark(r, slots.incarnation(r))

    def started_all(self) -> None:
        """The full-group restart is over, whether it worked or not."""
        self.restarting.clear()

    def take_joining(self, ranks: Collection[int] | None = None) -> dict[int, str]:
        """The ranks that joined the restart, with why, taken; `ranks`: only those of them."""
        taken = {r: why for r, why in self.joining.items() if ranks is None or r in ranks}
        for r in taken:
            del self.joining[r]
        return taken

    # -------------------------------------------------------------- record
    def record(self, incarnations: Mapping[int, int], now: float) -> dict[str, Any]:
        """This part of the `recovery` section of the state record."""
        return {
            "detected_at": {str(r): t for r, t in self.detected_at.items()},
            "joining": {str(r): why for r, why in self.joining.items()},
            "losses": self.losses.record(incarnations, now),
        }

    def section(self, incarnations: Mapping[int, int], now: float) -> LossesSection:
        """This part as the run's record holds it (`record`'s, typed)."""
        losses = self.losses
        recent = {
            r: (n, at) for r, (n, at) in losses.lost_on.items() if now - at <= losses.window_s
        }
        nodes = {n for n, _ in recent.values()}
        return LossesSection(
            detected_at=dict(self.detected_at),
            joining=dict(self.joining),
            reported=tuple(sorted((r, i) for r, i in losses.reported if incarnations.get(r) == i)),
            lost_on=dict(sorted(recent.items())),
            held={n: tuple(sorted(rs)) for n, rs in sorted(losses.held.items()) if n in nodes},
        )

    @classmethod
    def from_section(cls, section: LossesSection | None) -> LostRanks:
        """This part back from the run's record (None: nothing lost yet)."""
        if section is None:
            return cls()
        losses = Losses(NODE_LOSS_WINDOW_S)
        losses.reported = set(section.reported)
        losses.lost_on = dict(section.lost_on)
        losses.held = {n: set(rs) for n, rs in section.held.items()}
        return cls(
            losses=losses, detected_at=dict(section.detected_at), joining=dict(section.joining)
        )

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> LostRanks:
        """This part back from a `recovery` section (None or empty: nothing lost yet)."""
        if not record:
            return cls()
        return cls(
            losses=Losses.from_record(record.get("losses"), NODE_LOSS_WINDOW_S),
            detected_at={int(r): float(t) for r, t in record.get("detected_at", {}).items()},
            joining={int(r): str(why) for r, why in record.get("joining", {}).items()},
        )
