"""The run as a whole: one owner of its state record, and the decisions about its ranks' ends.

`RunCore` holds every section of the supervisor's state record
(`RunRecord`): the policy side (`Controller`), the job's phase
(`JobStateMachine`), the rank slots, each rank's final result, the run's
status once it ended, the chaos crash points passed, the worker group's
section, the restart's, the hang watch (`HangWatch`, whose entries are the
record's once it has taken the ranks in: `Watching`; until then the
restored ones), and the losses reported (`LostRanks`). Nothing outside
gives its part at write time: the shell's worker group and restart send
their sections as they change (`GroupMoved`, `RestartMoved`), and read
them back from here. `record` builds the state record from these fields
only; `restore` is its inverse.

`step(input) -> effects` takes one input about the run:

- `Report`: a rank's report batch, sent by the rank itself or as one item of
  its node agent's call: taken once by the rank's slot (a batch number seen
  already is a call Ray retried: answered again, not taken again; one of a
  replaced process is refused), then by the controller;
- `GroupStarted`: every rank of the first group joined its generation;
- `RankReturned`: a rank's run call returned its summary (its training function ended);
- `RankDied`: a rank's process is gone (its run call raised, or the call that
  follows an adopted rank found it gone): it is lost, as below;
- `RankLost`: a rank found lost (hung, gone, or with its node): where the loss
  goes and what the job does about it is `LostRanks`'s to decide
  (`supervisor.core.lost_ranks`); `RanksMoving`: lost ranks nothing replaced
  that move again bring a degraded job back;
- `OperatorStop`: `remedy stop`: a final checkpoint on every rank, then a clean end;
- `Pass`: a pass of the supervisor's loop: an operator's stop or the policy's
  abort moves the job to aborting (once, and only from running or degraded:
  a restart under way is let finish, so the ranks stop from a formed group);
- `RanksAllEnded`: every rank has ended: the results are final;
- `Ending`: the loop is over (every rank ended) or the supervisor failed:
  the run's status, decided from the ranks' results and the job's phase;
- `Ended`: the run's summary is written: the run has ended;
- `GroupMoved`, `RestartMoved`: the worker group's or the restart's section changed;
- `Watching`: the hang watch takes every rank in, each as the restored record had it;

and returns what the shell carries out: `StopAsked` (a stop taken), `Answer` (the rank is answered in
this call with the commands it owes), `Taken` (the batch the controller
accepted, for the hang watch, a restart waiting on the group and the
displays), `BatchesLost` and `OutageNotes` (for the history), `ReplacementFailed` (a rank a
restart is starting failed), `RankEnded` (the displays show its status),
`Status` (the run's), and what became of a loss (`Dropped`,
`Joined`, `ToPolicy`, `NotReplaced`: `Recovery.carry_losses`). The job's moves are journaled by the job state
machine's own journal (a history line and a state record).

No Ray, no torch, no I/O and no clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from remedy.control.decide import Controller
from remedy.control.hang_watch import HangWatch
from remedy.control.job import (
    AbortRequested,
    JobState,
    JobStateMachine,
    Phase,
    RanksEnded,
    Started,
    TransitionError,
)
from remedy.control.lost_ranks import Dropped as Dropped
from remedy.control.lost_ranks import Joined as Joined
from remedy.control.lost_ranks import LostRanks, RankLost, RanksMoving
from remedy.control.lost_ranks import NotReplaced as NotReplaced
from remedy.control.lost_ranks import ReplacementFailed as ReplacementFailed
from remedy.control.lost_ranks import ToPolicy as ToPolicy
from remedy.control.record import RunRecord
from remedy.control.record_holes import RecordHoles
from remedy.control.sections import GroupSection, HangSection, RestartSection
from remedy.control.slots import RankSlots

_GOING = (Phase.RUNNING, Phase.DEGRADED)


# What one item of a node agent's call may stand for: batch numbers of one rank (a digest
# of a few seconds of it).
MAX_ITEM_SEQS = 4096


# ------------------------------------------------------------------- inputs
@dataclass(frozen=True, slots=True)
class Report:
    """A rank's report batch (untrusted): its own call's (`node` None), or one item of the
    call of the agent of `node`, which carries `seqs`, the batch numbers it stands for;
    `now`: the wall time it arrived (None: the time of the last input that told one)."""

    batch: Any
    node: str | None = None
    now: float | None = None


@dataclass(frozen=True, slots=True)
class RankReturned:
    """The run call of `rank`'s process `incarnation` returned `result` (its summary)."""

    rank: int
    incarnation: int
    result: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class RankDied:
    """`rank`'s process `incarnation` is gone, found at wall time `at`: `error` is its result's,
    `reason` the loss's."""

    rank: int
    incarnation: int
    error: str
    reason: str
    at: float
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GroupStarted:
    """Every rank of the first group joined generation `generation`."""

    generation: int = 0


@dataclass(frozen=True, slots=True)
class OperatorStop:
    """An operator's stop (`remedy stop`), with its reason."""

    reason: str


@dataclass(frozen=True, slots=True)
class Pass:
    """A pass of the supervisor's loop."""


@dataclass(frozen=True, slots=True)
class RanksAllEnded:
    """Every rank has ended (the loop is over): the results are final."""


@dataclass(frozen=True, slots=True)
class Ending:
    """The loop is over; `error`: the supervisor failed (a bug of its own), and why."""

    error: str | None = None


@dataclass(frozen=True, slots=True)
class Ended:
    """The run's summary is written with `status`."""

    status: str


@dataclass(frozen=True, slots=True)
class GroupMoved:
    """The worker group's section changed: a generation, an actor name, a spare, a node."""

    group: GroupSection


@dataclass(frozen=True, slots=True)
class RestartMoved:
    """The restart's section changed: its machine moved, a stage passed, a restart done."""

    restart: RestartSection


@dataclass(frozen=True, slots=True)
class Watching:
    """The loop starts watching every rank at monotonic time `now` (`RunCore.watch`): each
    rank with the entry the restored record holds for it (its own timeout, counted from
    `now`), else with the start-up allowance. The watch's entries are the record's from
    then on, in place of the restored ones."""

    now: float


Input = (
    Report
    | GroupStarted
    | RankReturned
    | RankDied
    | RankLost
    | RanksMoving
    | OperatorStop
    | Pass
    | RanksAllEnded
    | Ending
    | Ended
    | GroupMoved
    | RestartMoved
    | Watching
)


# ------------------------------------------------------------------ effects
@dataclass(frozen=True, slots=True)
class StopAsked:
    """An operator's stop was taken: its commands are pending (`Controller.stop`)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer `rank` in this call with the commands it owes (`retried`: a call seen already,
    whose reply was lost)."""

    rank: int
    retried: bool = False


@dataclass(frozen=True, slots=True)
class Taken:
    """The controller accepted this report of `rank` at `tick` (`report`: the valid part, as a
    batch); `ending`: the rank's loop is done; `collective_failed`: its collective just
    failed (a peer may be gone)."""

    rank: int
    tick: int
    report: Any  # report_validation.Report
    ending: bool = False
    collective_failed: bool = False


@dataclass(frozen=True, slots=True)
class BatchesLost:
    """`records` step records of `rank` never came; `count` batch numbers were given up."""

    rank: int
    node: str | None
    count: int
    records: int = 0  # the step records missing (`RecordHoles`)


@dataclass(frozen=True, slots=True)
class OutageNotes:
    """Outages a rank or its driver saw end (untrusted notes, for `liveness.valid_note`)."""

    notes: Any


@dataclass(frozen=True, slots=True)
class RankEnded:
    """`rank` ended with `status`: its slot is closed; the displays show it."""

    rank: int
    status: str


@dataclass(frozen=True, slots=True)
class Status:
    """The run ends with `status`."""

    status: str


Effect = (
    StopAsked
    | Answer
    | Taken
    | BatchesLost
    | OutageNotes
    | ReplacementFailed
    | RankEnded
    | Status
    | Dropped
    | Joined
    | ToPolicy
    | NotReplaced
)


@dataclass
class RunCore:
    """The run's state and its ranks' ends (see the module docstring)."""

    controller: Controller
    job: JobStateMachine
    slots: RankSlots
    incarnation: int
    started: float
    # rank -> its final result (its process's summary, or why it is gone)
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Every rank ended (the results are final): a supervisor restarted from here finishes.
    ranks_ended: bool = False
    ended: str | None = None  # the run's status, once its summary is written
    crashed: set[str] = field(default_factory=set)  # chaos crash points passed
    # The worker group's section (None: no group started yet) and the restart's (None: no
    # recovery built yet); the shell sends each as it changes (`GroupMoved`, `RestartMoved`).
    group: GroupSection | None = None
    restart: RestartSection | None = None
    # The hang watch; until it has taken the ranks in (`Watching`), the restored entries.
    watch: HangWatch = field(default_factory=HangWatch)
    hang: HangSection = field(default_factory=HangSection)
    watching: bool = False
    # The losses reported and what became of them (the `recovery` section's loss part).
    lost: LostRanks = field(default_factory=LostRanks)
    # Each rank process's step records seen, to tell a really lost one (`BatchesLost`).
    holes: RecordHoles = field(default_factory=RecordHoles)

    # ---------------------------------------------------------------- step
    def step(self, inp: Input) -> list[Effect]:
        match inp:
            case Report(batch, None, now):
                return self._report(batch, now)
            case Report(item, str() as node, now):
                return self._item(item, node, now)
            case RankReturned(rank, incarnation, result):
                return self._returned(rank, incarnation, dict(result))
            case RankDied(rank, incarnation, error, reason, at, details):
                if incarnation == self.slots.incarnation(rank):
                    self.results[rank] = {"rank": rank, "status": "failed", "error": error}
                return self.step(RankLost(rank, "rank_dead", reason, at, details, incarnation))
            case RankLost() | RanksMoving():
                return list(
                    self.lost.step(inp, controller=self.controller, job=self.job, slots=self.slots)
                )
            case GroupStarted(generation):
                self.job.step(Started(generation))
                return []
            case OperatorStop(reason):
                # False, changing nothing, when a stop or an abort is under way already.
                return [StopAsked(reason)] if self.controller.stop(reason) else []
            case Pass():
                self._abort_if_asked()
                return []
            case RanksAllEnded():
                self.ranks_ended = True
                return []
            case Ending(error):
                return [Status(self._end(error))]
            case Ended(status):
                self.ended = status
                return []
            case GroupMoved(group):
                self.group = group
                return []
            case RestartMoved(restart):
                self.restart = restart
                return []
            case Watching(now):
                self._watch_from(now)
                return []
        raise TypeError(f"not an input of the run: {inp!r}")

    def _report(self, batch: Any, now: float | None) -> list[Effect]:
        """A rank's own report: its slot takes its number, then the controller the batch."""
        out: list[Effect] = []
        if isinstance(batch, dict):
            rank, duplicates = batch.get("rank"), self.slots.refused_duplicate
            if not self.slots.accept(rank, batch.get("incarnation"), batch.get("seq"), now):
                if self.slots.refused_duplicate > duplicates and type(rank) is int:
                    # Seen already (a call Ray retried after a restart): its reply was lost,
                    # so it is answered again with what the rank still owes.
                    out.append(Answer(rank, retried=True))
                return out
            below = batch.pop("unanswered_from", None)
            out += self._answered_below(rank, batch.get("seq"), below, records=batch)
        out += self._take(batch, now, write_metrics=True)
        taken = next((e for e in out if isinstance(e, Taken)), None)
        if taken is not None:  # an invalid batch gets no commands
            out.append(Answer(taken.rank))
        return out

    def _item(self, item: Any, node: str, now: float | None) -> list[Effect]:
        """One rank's item of a node agent's call: its slot takes each batch number it stands
        for; an item all of whose numbers were seen is a retried call's (answered, not taken)."""
        c = self.controller
        if not isinstance(item, dict):
            c.rejected["batch_item"] += 1
            return []
        rank, incarnation, seqs = item.get("rank"), item.get("incarnation"), item.pop("seqs", [])
        if type(rank) is not int or rank not in self.slots.slots or not isinstance(seqs, list):
            c.rejected["batch_item"] += 1
            return []
        duplicates = self.slots.refused_duplicate
        fresh = [s for s in seqs[:MAX_ITEM_SEQS] if self.slots.accept(rank, incarnation, s, now)]
        if seqs and not fresh:
            retried = self.slots.refused_duplicate > duplicates
            return [Answer(rank, retried=True)] if retried else []
        if not seqs and not self.slots.accept(rank, incarnation, None, now):
            return []
        newest = max((s for s in seqs[:MAX_ITEM_SEQS] if type(s) is int), default=None)
        # Only the lead's item carries every step record; another rank's, a digest of them.
        full = item if rank == self.controller.goodput.lead else None
        out = self._answered_below(
            rank, newest, item.pop("unanswered_from", None), node, records=full
        )
        out += self._take(item, now, write_metrics=False)
        out.append(Answer(rank))  # an agent's rank is answered whether its item was valid or not
        return out

    def _answered_below(
        self,
        rank: Any,
        seq: Any,
        below: Any,
        node: str | None = None,
        *,
        records: Any = None,
    ) -> list[Effect]:
        """The rank says every batch number below `below` was answered: the ones its slot still
        awaits are not awaited any more (`RankSlots.answered_below`). Only a node agent that
        answered them and died before sending them on leaves any (step records only: it
        wrote those to its metrics file, and answers a batch with events or outcomes only
        once it is sent on), or a report that failed at the rank and went out again under a
        new number.

        Numbers given up are a loss only where step records are missing (`records`: the
        batch, whose metrics go to `RecordHoles`; None: its records are not all there to
        tell, a digest): `BatchesLost` then, with the records missing."""
        if type(rank) is not int or rank not in self.slots.slots:
            return []
        lost = self.slots.answered_below(rank, seq, below)
        if not isinstance(records, dict):
            return []
        metrics = records.get("metrics")
        missing = self.holes.take(
            rank, records.get("incarnation"), metrics if isinstance(metrics, list) else []
        )
        return [BatchesLost(rank, node, lost, missing)] if missing else []

    def _take(self, batch: Any, now: float | None, *, write_metrics: bool) -> list[Effect]:
        """The controller takes the batch; `write_metrics=False`: an agent's item, whose step
        records are in the agent's metrics file already."""
        out: list[Effect] = []
        if isinstance(batch, dict) and "outages" in batch:
            out.append(OutageNotes(batch.pop("outages")))
        # The rank's loop is done: it takes no more steps, so no progress is to be waited for.
        ending = isinstance(batch, dict) and batch.pop("ending", None) is True
        # The rank's collective has just failed: a peer may be gone (`Recovery.alarm`).
        failed = isinstance(batch, dict) and batch.pop("collective_failed", None) is True
        c = self.controller
        # Ranks whose earlier reports are still on their way: an incident of theirs may be too.
        c.incomplete = self.slots.incomplete()
        c.ingest(batch, now=now, write_metrics=write_metrics, answer=False)
        report = c.last_report
        if report is not None:
            out.append(Taken(report.rank, report.tick, report, ending, failed))
        return out

    def _returned(self, rank: int, incarnation: int, result: dict[str, Any]) -> list[Effect]:
        if incarnation != self.slots.incarnation(rank):
            return []  # a replaced incarnation's late result
        self.results[rank] = result
        status = str(result.get("status"))
        out: list[Effect] = []
        if status == "failed":  # a restart starting this rank learns at once
            out.append(ReplacementFailed(rank, str(result.get("error"))))
        self.slots.end(rank)
        out.append(RankEnded(rank, status))
        return out

    def _watch_from(self, now: float) -> None:
        ticks = self.controller.tick_of
        entries = self.hang.entries
        for rank in range(self.controller.world_size):
            entry = list(entries[rank]) if rank in entries else None
            if not self.watch.resumed(rank, now, ticks.get(rank, -1), entry):
                self.watch.started(rank, now)
        self.watching = True

    def _abort_if_asked(self) -> None:
        c = self.controller
        if self.job.state.phase not in _GOING:
            return
        if c.stop_reason is not None:
            self.job.step(AbortRequested(f"an operator's stop: {c.stop_reason}"))
        elif c.abort_reason is not None:
            self.job.step(AbortRequested(f"the policy's abort: {c.abort_reason}"))

    def _end(self, error: str | None) -> str:
        """The run's status, and the job's last move."""
        c = self.controller
        results = [self.results[r] for r in sorted(self.results)]
        every = len(results) == self.controller.world_size
        going = self.job.state.phase in _GOING
        if error is not None:
            status = "failed"
        elif c.stop_reason is not None:
            status = "stopped"
        elif c.abort_reason is not None:
            status = "aborted"
        elif every and going and all(r.get("status") == "completed" for r in results):
            status = "completed"  # degraded: the lost ranks came back, and completed
        elif every and going and all(r.get("status") in ("completed", "aborted") for r in results):
            # A rank stopped itself (an OOM nothing relieved, `oom_give_up_steps`): the
            # run is aborted for that rank's reason, not failed.
            status = "aborted"
            c.abort_reason = next(
                str(r.get("stop_reason") or "a rank stopped itself")
                for r in results
                if r.get("status") == "aborted"
            )
        else:
            status = "failed"
        # A degraded job ends for the reason it degraded (a lost rank nothing replaced).
        why = self.job.state.reason if self.job.state.phase is Phase.DEGRADED else ""
        with contextlib.suppress(TransitionError):  # ended already
            self.job.step(RanksEnded(status, why if status != "completed" else ""))
        return status

    # ------------------------------------------------------------- queries
    def all_completed(self) -> bool:
        """Every rank's current process completed the run."""
        results = self.results
        return len(results) == self.controller.world_size and all(
            r.get("status") == "completed" for r in results.values()
        )

    def crash_due(self, point: str, asked: Collection[str]) -> bool:
        """Chaos: whether to crash at `point` now (asked for, and not passed in an earlier
        life); a point due is marked passed, for the state record written before the crash."""
        if point not in asked or point in self.crashed:
            return False
        self.crashed.add(point)
        return True

    # -------------------------------------------------------------- record
    def record(self, now: float) -> RunRecord:
        """The state record of the run as it stands at wall time `now`."""
        incarnations = {r: s.incarnation for r, s in self.slots.slots.items()}
        hang = HangSection.from_json(self.watch.record()) if self.watching else self.hang
        return RunRecord(
            incarnation=self.incarnation,
            started=self.started,
            job=self.job.state,
            slots=self.slots.sections(),
            last_seq=self.slots.seqs(),
            group=self.group,
            controller=self.controller.state_dict(),
            restart=self.restart,
            losses=self.lost.section(incarnations, now),
            crashed=tuple(sorted(self.crashed)),
            hang=hang,
            ranks_ended=dict(self.results) if self.ranks_ended else None,
            ended=self.ended,
        )

    def restore(self, run: RunRecord, now: float | None = None) -> None:
        """Take the run back from its newest state record (`RunRecord.from_record`); `now`:
        the wall time of the restore."""
        self.controller.load_state_dict(dict(run.controller), now)
        self.slots = RankSlots.from_sections(
            run.slots, run.last_seq, rejected=self.controller.rejected
        )
        self.job.state = run.job
        self.started = run.started
        self.group = run.group
        self.restart = run.restart
        self.lost = LostRanks.from_section(run.losses)
        for d in self.controller.deferred.values():
            if d.action != "restart_rank":
                continue
            for rank in d.ranks:  # found gone on adoption: part of that restart, not a new loss
                if rank in self.slots.slots:
                    self.lost.losses.mark(rank, self.slots.incarnation(rank))
        self.hang = run.hang
        self.watching = False
        self.crashed = set(run.crashed)
        if run.ranks_ended is not None:
            self.results_ended(run.ranks_ended)
        self.ended = run.ended

    def results_ended(self, results: Mapping[Any, Any]) -> None:
        """Every rank had ended, with `results` (rank -> result; keys as a record holds them)."""
        self.ranks_ended = True
        self.results = {int(r): dict(v) for r, v in results.items()}

    def restart_job(self) -> None:
        """The group starts over from nothing (a supervisor that died while starting it)."""
        self.job.state = JobState()
