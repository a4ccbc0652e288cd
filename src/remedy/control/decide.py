"""The decision loop: report batches in, journaled decisions and commands out.

One `Controller` serves a whole job. The Ray supervisor actor wraps it; in
single-process mode the Guard drives one directly. Per batch it validates
the untrusted input (a malformed event is rejected and counted, never
raised), records anomalies and metrics, asks the policy engine, counts
each decision as a change (its shell writes a state record holding it before
a reply can carry its command) and puts it in the history, queues in-process
actions as commands for every rank, and resolves decisions once the ranks
report how applying them went.

With several ranks it also watches for stragglers, which no rank can see on
its own: it keeps each rank's recent compute times (step time minus time in
collectives) from the metrics and runs a `StragglerWatch` once per new step.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import operator
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from remedy.control import decide_state as control_state
from remedy.control.effects import (
    AnomalyRecord,
    DecisionRecord,
    Effect,
    GroupAction,
    HistoryRecord,
    Journal,
    MetricRecords,
    Notify,
    log_notify,
)
from remedy.control.goodput import REWINDING_ACTIONS, STALLING_ACTIONS, GoodputLedger
from remedy.control.straggler import StepTimes, StragglerWatch
from remedy.policies import (
    DISRUPTIVE_ACTIONS,
    SUPERVISOR_ACTIONS,
    AnomalyEvent,
    Decision,
    Engine,
    EventError,
    IncidentMerger,
)
from remedy.protocol.commands import Command, Outcome
from remedy.protocol.reports import Limits, RankMark, Report, validate_batch

log = structlog.get_logger("remedy.control")

DEFAULT_LIMITS = Limits()

# Commands the controller adds beside the decisions: an operator's or a policy's stop of
# every rank's loop, and the answer to a replay the ranks hold for (`_answer_replay`).
INTERNAL_SUFFIXES = ("-stop", "-answer")


def _internal(decision_id: str) -> bool:
    return decision_id.endswith(INTERNAL_SUFFIXES)


class _Default(enum.Enum):
    """Marks an argument left out, where `None` means "off"."""

    TOKEN = 0


class Outcomes(dict[int, Outcome]):
    """A pending command's outcomes by rank, kept grouped as they come (`grouped`).

    A command goes to every rank and its outcomes mostly say the same: the
    outcomes that differ only in their rank form one group, whose ranks are
    a bit mask. A state record writes the groups (`control_state.dump`); at
    4,096 ranks grouping every pending command's outcomes anew for each
    record was a third of the supervisor's event loop.
    """

    def __init__(self, items: Iterable[tuple[int, Outcome]] = ()) -> None:
        super().__init__()
        # group key -> [the outcome's fields but its rank, the ranks' bit mask, the key]
        self._groups: dict[tuple[Any, ...], list[Any]] = {}
        # rank -> its group's key: the group's own key object, so that an outcome keeps no
        # key of its own (4,096 ranks' outcomes of each pending command would otherwise keep
        # two tuples each, which the supervisor's garbage collector walked: 2/3 of the
        # objects its young generation held at 4,096 ranks, `supervisor_load.py --agents`).
        self._key_of: dict[int, tuple[Any, ...]] = {}
        for rank, outcome in items:
            self[rank] = outcome

    def __setitem__(self, rank: int, outcome: Outcome) -> None:
        if rank in self:
            self._ungroup(rank)
        super().__setitem__(rank, outcome)
        key = outcome_key(outcome)
        group = self._groups.get(key)
        if group is None:
            fields = outcome.to_dict()
            del fields["rank"]
            group = self._groups[key] = [fields, 0, key]
        group[1] |= 1 << rank
        self._key_of[rank] = group[2]

    def __delitem__(self, rank: int) -> None:
        super().__delitem__(rank)
        self._ungroup(rank)

    def pop(self, rank: int, *default: Any) -> Any:
        if rank in self:
            self._ungroup(rank)
        return super().pop(rank, *default)

    def clear(self) -> None:
        super().clear()
        self._groups.clear()
        self._key_of.clear()

    def _ungroup(self, rank: int) -> None:
        key = self._key_of.pop(rank)
        group = self._groups[key]
        group[1] &= ~(1 << rank)
        if not group[1]:
            del self._groups[key]

    def grouped(self) -> list[tuple[dict[str, Any], int]]:
        """(an outcome's fields but its rank, the bit mask of the ranks that reported it)."""
        return [(fields, mask) for fields, mask, _ in self._groups.values()]

    # Every other way to change a dict would bypass the groups.
    def update(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Outcomes: set outcomes one by one")

    def setdefault(self, rank: int, default: Outcome) -> Outcome:
        raise TypeError("Outcomes: set outcomes one by one")

    def popitem(self) -> tuple[int, Outcome]:
        raise TypeError("Outcomes: pop an outcome by its rank")


# An outcome's fields but its rank and result, as a tuple: what outcomes grouped together share.
_OUTCOME_FIELDS = operator.attrgetter(
    *(f.name for f in dataclasses.fields(Outcome) if f.name not in ("rank", "result"))
)


def outcome_key(o: Outcome) -> tuple[Any, ...]:
    """What outcomes that differ only in their rank share (the result as JSON, if any)."""
    return (
        _OUTCOME_FIELDS(o),
        json.dumps(o.result, sort_keys=True, default=str) if o.result else "",
    )


@dataclass
class _Pending:
    decision: Decision
    command: Command
    targets: set[int]
    dispatched_at: float
    outcomes: Outcomes = field(default_factory=Outcomes)
    # Lost ranks no longer awaited: their replacements still receive the
    # command (and apply it unless the adopted state has it done already).
    dropped: set[int] = field(default_factory=set)
    # The command as it goes out, built once: every report of every target gets it
    # until that rank answers (asdict deep-copies on each call).
    wire: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.wire = self.command.to_dict()


class Controller:
    """Policy-driven decisions for one job, with their journal."""

    def __init__(
        self,
        engine: Engine,
        *,
        world_size: int,
        journal: bool = True,
        group_actions: bool = False,
        notify: bool = False,
        command_lead: int = 1,
        straggler: StragglerWatch | _Default | None = _Default.TOKEN,
        limits: Limits = DEFAULT_LIMITS,
        started: float | None = None,
        nodes: Mapping[int, str] | None = None,
    ) -> None:
        """`straggler`: the slow-rank watch; by default a `StragglerWatch()` when
        `world_size > 1`, none for one rank; `None` turns it off. `limits`:
        how much a report batch may carry (`report_validation.Limits`).

        What the shell must do leaves as effects in `effects` (`take_effects`), in the
        order it must carry them out: `journal`: what the controller journals
        (`effects.Journal`; False: kept nowhere but in `decisions`); `group_actions`: a
        group action (restart_rank) as a `GroupAction`, answered with
        `resolve_group_action` (False: nothing owns the ranks, it fails at once);
        `notify`: a `notify` decision as a `Notify`, answered with `resolve_notify`
        (False: logged here and applied).

        Time arrives with the inputs (`ingest(now=...)`); `now` keeps the latest, which
        the calls that tell none use. `started`: when the run started, what a rank's
        first report is measured from (None: its first input's time). `nodes`: the node
        each rank runs on, stamped on its anomalies (`details["node"]`, what `group_by:
        [node]` counts by).
        """
        self.engine = engine
        self.nodes = nodes
        self.world_size = world_size
        self.journal = journal
        self.group_actions = group_actions
        self.notify = notify
        self.effects: list[Effect] = []  # what the shell is yet to carry out, in order
        self.notifying: dict[str, Decision] = {}  # `notify` decisions the shell carries
        self.command_lead = command_lead
        self.pending: dict[str, _Pending] = {}
        self._closed: set[str] = set()  # ids of commands no longer pending
        # The newest of them, all a state record keeps: an outcome later than these
        # after a restart is counted as unknown, and the record stays small.
        self._recent_closed: deque[str] = deque(maxlen=control_state.MAX_CLOSED_KEPT)
        self._seq = 0
        self.step_of: dict[int, int] = {}
        self.tick_of: dict[int, int] = {}
        self.last_seen: dict[int, float] = {}
        self.recent_loss: dict[int, deque[float]] = {}
        self.limits = limits
        self.rejected: Counter[str] = Counter()  # refused input, by reason
        self._logged: dict[str, int] = {}  # the count of each reason when last logged
        self._marks: dict[int, RankMark] = {}  # each rank's last accepted report
        self.rows = control_state.RankRows()  # the three maps above as a state record has them
        self._tick_counts: dict[int, dict[int, int]] = {}  # events accepted per rank and tick
        self.last_report: Report | None = None  # the valid parts of the last batch ingested
        self.now = 0.0 if started is None else started
        self._started = started
        self.anomaly_counts: Counter[str] = Counter()
        self.action_counts: Counter[str] = Counter()
        self.outcome_counts: Counter[str] = Counter()
        self.abort_reason: str | None = None
        self.stop_reason: str | None = None  # an operator's stop (`remedy stop`), see `stop`
        self.decisions: list[dict[str, Any]] = []  # journaled records, for the summary and tests
        # Ids with a line in decisions.jsonl: an outcome re-sent after a supervisor
        # restart resolves its decision again, and must not journal it twice.
        self._journaled: set[str] = set()
        # Bumped whenever what the controller promised changes (a decision, a
        # command closed, an anomaly, a dropped rank): the supervisor writes a state
        # record before a reply leaves when it moved (see `control_state`).
        self.changes = 0
        self.deferred: dict[str, Decision] = {}  # group actions under way
        if isinstance(straggler, _Default):
            straggler = StragglerWatch() if world_size > 1 else None
        # Each rank's recent compute times for the slow-rank watch (none without a watch).
        self.step_times = StepTimes(straggler) if straggler is not None else None
        self.incidents = IncidentMerger(world_size)
        # Ranks some of whose earlier reports have not come yet (Ray delivers an async
        # actor's calls in no set order, and retries them out of order after a restart):
        # their newest tick does not prove they reported the ticks below it. The shell sets
        # it from its rank slots before each batch.
        self.incomplete: frozenset[int] = frozenset()
        # Steps executed and kept, and where the time went (rank 0's records; see `goodput`).
        self.goodput = GoodputLedger()

    # ---------------------------------------------------------------- ingest
    def ingest(
        self,
        batch: Any,
        *,
        now: float | None = None,
        write_metrics: bool = True,
        answer: bool = True,
    ) -> list[dict[str, Any]]:
        """Take one report batch from a rank; return the commands that rank still owes.

        Each item is validated on its own (`report_validation`): invalid ones
        are counted in `rejected` by reason and change nothing; the rest are
        decided as if they had come alone. `write_metrics=False`: the step
        records are in a node agent's metrics file already (`supervisor.agent`).
        `answer=False`: nobody waits for the commands (an agent's call answers each
        of its ranks after every item was taken): none are built. `now`: when it
        arrived (wall time; None: the time of the last input that told one).
        """
        now = self._at(now)
        rank = batch.get("rank") if isinstance(batch, dict) else None
        key = rank if isinstance(rank, int) else -1
        last = self._marks.get(key)
        report = validate_batch(
            batch,
            world_size=self.world_size,
            last=last,
            # Only a rank's first report is measured from the origin (a max over every rank).
            origin=RankMark(
                max(self.step_of.values(), default=0),
                0,
                now if self._started is None else self._started,
            )
            if last is None
            else None,
            now=now,
            limits=self.limits,
            rejected=self.rejected,
            tick_counts=self._tick_counts.get(key) if last is not None else None,
        )
        self._log_rejections()
        self.last_report = report
        if report is None:
            return []
        rank = report.rank
        self._tick_counts[rank] = report.tick_counts
        mark = self._marks[rank] = RankMark(report.step, report.tick, now)
        self.last_seen[rank] = now
        self.step_of[rank] = max(self.step_of.get(rank, 0), report.step)
        self.tick_of[rank] = report.tick
        self.rows.took(rank, self.step_of[rank], mark)
        for record in report.metrics:
            self._metrics(rank, record)
        if write_metrics and report.metrics:
            self._emit(MetricRecords(report.metrics))
        for outcome in report.outcomes:
            self._outcome(outcome)
        for ev in report.events:
            self._record(ev)
        # One fault seen on several ranks or through a collective is one incident.
        ticks = (
            {r: t for r, t in self.tick_of.items() if r not in self.incomplete}
            if self.incomplete
            else self.tick_of
        )
        events = self.incidents.offer(report.events, ticks=ticks, now=now)
        if self.step_times is not None and self.step_times.fresh:
            events += self._check_stragglers()
        if events:
            self._decide(events, now)
        return self.commands_for(rank) if answer else []

    def _decide(self, events: list[AnomalyEvent], now: float) -> None:
        """The one place where the valid events of a batch reach the policy engine.

        Every event passes here: the ranks' detectors, the straggler watch, and
        the supervisor's own (a lost rank is ingested as a batch in its name).
        Events that are one incident seen from several ranks belong merged here,
        before the policy decides.
        """
        self.handle(self.engine.decide([self._stamped(e) for e in events], now=now))

    def _stamped(self, ev: AnomalyEvent) -> AnomalyEvent:
        """`ev` with the node its rank runs on in its details, when known."""
        node = self.nodes.get(ev.rank) if self.nodes is not None else None
        if node is None or ev.node == node:
            return ev
        return dataclasses.replace(ev, details={**ev.details, "node": node})

    def _log_rejections(self) -> None:
        """Log a reason's 1st, 10th, 100th, ... rejection: a flood must not flood the log too."""
        for reason, count in self.rejected.items():
            logged = self._logged.get(reason, 0)
            if count >= max(1, logged * 10):
                self._logged[reason] = count
                log.warning("report_input_rejected", reason=reason, count=count)

    @property
    def rejected_events(self) -> int:
        """Events refused, whatever the reason."""
        return sum(n for reason, n in self.rejected.items() if reason.startswith("event"))

    @property
    def rejected_batches(self) -> int:
        """Whole batches refused: a bad header (rank, step, tick), or by their rank's slot."""
        return sum(n for reason, n in self.rejected.items() if reason.startswith("batch_"))

    def settled(self, tick: int) -> bool:
        """Whether every decision on the step executed at `tick` is taken: every rank has
        reported past it, none with earlier reports still on their way, and no incident of
        it (or of an earlier tick) is held. Ranks holding at a flagged step's boundary wait
        for this (`workers.flag_hold`); decisions are taken as reports are ingested, so
        the commands decided are in the same reply."""
        if self.incomplete or self.incidents.holds_through(tick):
            return False
        return all(self.tick_of.get(r, -1) > tick for r in range(self.world_size))

    def last_steps(self) -> dict[int, int]:
        """Each rank's step in its last accepted report (after a rollback, lower than its most)."""
        return {rank: mark.step for rank, mark in self._marks.items()}

    def commands_for(self, rank: int) -> list[dict[str, Any]]:
        """The commands `rank` still owes (each a copy)."""
        return self.commands_for_ranks((rank,))[rank]

    def commands_for_ranks(self, ranks: Iterable[int]) -> dict[int, list[dict[str, Any]]]:
        """The commands each of `ranks` still owes, for one reply: each command is copied once
        and the ranks owing it share that copy (its receiver takes one per rank:
        `AgentCore.commands`)."""
        copies: dict[str, dict[str, Any]] = {}
        out: dict[int, list[dict[str, Any]]] = {}
        for rank in ranks:
            owed = out[rank] = []
            for decision_id, p in self.pending.items():
                if (rank in p.targets and rank not in p.outcomes) or rank in p.dropped:
                    wire = copies.get(decision_id)
                    if wire is None:
                        wire = copies[decision_id] = {**p.wire, "params": dict(p.wire["params"])}
                    owed.append(wire)
        return out

    def record_anomaly(self, ev: AnomalyEvent) -> None:
        """Count and log an anomaly that no policy decision follows (a rank lost while a
        restart that takes it in is already under way)."""
        self._record(ev)

    def _record(self, ev: AnomalyEvent) -> None:
        """Count and log one valid anomaly, whoever saw it."""
        self.changes += 1
        self.anomaly_counts[ev.kind] += 1
        self.goodput.event(ev.step, ev.kind)
        if self.journal:
            self._emit(AnomalyRecord(self._stamped(ev).to_dict()))

    def _metrics(self, rank: int, record: Any) -> None:
        if not isinstance(record, dict):
            return
        self.goodput.record(rank, record)
        loss = record.get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            self.recent_loss.setdefault(rank, deque(maxlen=10)).append(float(loss))
        if self.step_times is not None:
            self.step_times.add(rank, record)

    # ------------------------------------------------------------ stragglers
    @property
    def straggler(self) -> StragglerWatch | None:
        """The slow-rank watch, if on."""
        return self.step_times.watch if self.step_times is not None else None

    def _check_stragglers(self) -> list[AnomalyEvent]:
        """Run the watch once per distinct newest step across ranks; record what it finds."""
        assert self.step_times is not None
        events = self.step_times.check()
        for ev in events:
            self._record(ev)
        return events

    def forget_rank(self, rank: int) -> None:
        """Drop a rank's step-time history (a replaced rank is a new process)."""
        if self.step_times is not None:
            self.step_times.forget(rank)

    # ------------------------------------------------------------- decisions
    def handle(self, decisions: Iterable[Decision]) -> None:
        """Journal and dispatch decisions from the engine (new ones or follow-ups)."""
        for d in decisions:
            self.changes += 1
            if d.suppressed:
                self._journal(d, "suppressed")
            elif d.dry_run:
                self._journal(d, "dry_run")
            elif d.action in SUPERVISOR_ACTIONS:
                self._supervisor_action(d)
            else:
                self._dispatch(d)

    def _dispatch(self, d: Decision) -> None:
        apply_at = max(self.step_of.values(), default=0) + self.command_lead
        self._seq += 1
        command = Command.from_decision(
            d,
            apply_at_step=apply_at,
            apply_at_tick=self._tick() + self.command_lead,
            seq=self._seq,
        )
        targets = set(range(self.world_size))
        if (
            d.action in REWINDING_ACTIONS
        ):  # the ranks' next rewind is this one's: its steps are lost to it
            self.goodput.expect_rewind(self.now, d.anomaly.kind)
        self._emit(
            HistoryRecord(
                {"type": "decided", "decision": d.to_dict(), "command": command.to_dict()}
            )
        )
        self.pending[d.decision_id] = _Pending(d, command, targets, self.now)

    def _supervisor_action(self, d: Decision) -> None:
        if d.action == "notify":
            message = d.params.get("message")
            effect = Notify(
                d.decision_id, d.rule, d.reason, None if message is None else str(message), d
            )
            if not self.notify:
                self._resolve_now(d, *log_notify(effect))
                return
            # The shell sends it on and answers with `resolve_notify`.
            self.notifying[d.decision_id] = d
            self._emit(effect)
        elif d.action == "abort":
            self.abort_reason = str(d.params.get("reason") or d.reason)
            self._emit(HistoryRecord({"type": "decided", "decision": d.to_dict(), "command": None}))
            self._resolve_now(d, "applied", "run aborted")
            # Ranks stop at their next boundary.
            self._dispatch_stop(d)
        elif not self.group_actions:
            self._resolve_now(d, "failed", f"{d.action} needs a worker group; none is attached")
        else:
            self._emit(HistoryRecord({"type": "decided", "decision": d.to_dict(), "command": None}))
            if d.action in STALLING_ACTIONS:  # the group stalls until it ends: time lost to it
                self.goodput.disrupted(self.now, d.anomaly.kind)
            # Under way until the shell that owns the ranks answers (`resolve_group_action`).
            self.deferred[d.decision_id] = d
            self._emit(GroupAction(d))

    def stop(self, reason: str) -> bool:
        """An operator's stop: `checkpoint_now` on every rank, then each rank's loop ends.

        Both commands go out together, the checkpoint first (ranks apply them in
        sequence order at one boundary); a failed checkpoint is journaled and the
        ranks stop anyway. False, changing nothing, when a stop or an abort is
        already under way.
        """
        if self.stop_reason is not None or self.abort_reason is not None:
            return False
        self.stop_reason = reason
        step = max(self.step_of.values(), default=0)
        d = Decision(
            decision_id=f"{self.engine.run_id}-operator",
            step=step,
            ranks=tuple(range(self.world_size)),
            rule="remedy stop",
            anomaly=AnomalyEvent(
                kind="operator_stop", rank=0, step=step, source="operator", ts=self.now
            ),
            action="checkpoint_now",
            params={"reason": reason},
            reason=f"an operator stopped the run ({reason}): final checkpoint, then a clean end",
        )
        self._dispatch(d)
        self._dispatch_stop(d)
        # A new promise: the state record must hold both commands before a reply
        # carries them (a crash in between lost the stop, applied on some ranks only).
        self.changes += 1
        return True

    def resolve_group_action(
        self, decision_id: str, outcome: str, detail: str, **extra: Any
    ) -> None:
        """The shell's answer to a `GroupAction`: how the group action ended."""
        d = self.deferred.pop(decision_id)
        if d.action == "restart_rank" and outcome == "applied":
            for rank in d.ranks:
                self.forget_rank(rank)
        self._emit(
            HistoryRecord({"type": "resolved", "decision_id": decision_id, "outcome": outcome})
        )
        self._journal(d, outcome, detail=detail, **extra)
        self.handle(
            self.engine.record_outcome(decision_id, outcome, tick=self._tick(), detail=detail)
        )

    def resolve_notify(self, decision_id: str, outcome: str, detail: str) -> None:
        """The shell's answer to a `Notify`: how sending it went ("applied", "failed")."""
        self._resolve_now(self.notifying.pop(decision_id), outcome, detail)

    def rewound(self, tick: int, resumed: str) -> list[str]:
        """Every rank restarted from tick `tick` (`resumed`: from where, as a sentence's end).

        The steps from there on run again, so what was decided on them is settled
        by the restart: a pending rewind (a rollback) of an anomaly at or after
        `tick` is applied by it, since no rank holds any state from after it any
        more (the new ranks would otherwise rewind again at their first boundary,
        and skip batches that were never bad). An anomaly that comes again in the
        redone steps is a new incident, decided anew. Returns the decisions settled.
        """
        self.incidents.rewound(tick)
        settled = []
        for pending in list(self.pending.values()):
            d = pending.decision
            if (
                _internal(d.decision_id)
                or d.action not in REWINDING_ACTIONS
                or d.anomaly.tick < tick
            ):
                continue
            detail = (
                f"carried out by the full-group restart: every rank resumed {resumed}, before "
                f"this anomaly's step {d.anomaly.step}; the steps after it run again, and an "
                "anomaly that comes again there is decided anew"
            )
            self._close(d.decision_id)
            self._emit(
                HistoryRecord(
                    {"type": "resolved", "decision_id": d.decision_id, "outcome": "applied"}
                )
            )
            follow = self.engine.record_outcome(
                d.decision_id, "applied", tick=self._tick(), detail=detail
            )
            self._journal(d, "applied", detail=detail, apply_at_step=pending.command.apply_at_step)
            self.handle(follow)
            settled.append(d.decision_id)
        return settled

    def drop_rank(self, rank: int) -> list[str]:
        """A rank was lost: it leaves the targets of every pending command.

        A decision then resolves once every live target has answered. A
        disruptive one (a rollback) still waiting for others gives up the
        disruption budget, so the `restart_rank` that brings the lost rank back
        is not held behind it (the rollback still completes on the live ranks,
        and a replacement adopts it with the survivors' state). Returns the
        pre-empted decision ids.
        """
        preempted = []
        self.changes += 1
        for pending in list(self.pending.values()):
            if rank not in pending.targets:
                continue
            pending.targets.discard(rank)
            pending.outcomes.pop(rank, None)
            pending.dropped.add(rank)
            decision_id = pending.command.decision_id
            if _internal(decision_id):
                if set(pending.outcomes) >= pending.targets:
                    del self.pending[decision_id]
                continue
            failed = [o for o in pending.outcomes.values() if o.outcome != "applied"]
            if pending.targets and (failed or set(pending.outcomes) >= pending.targets):
                self._resolve(pending, failed)
            elif pending.decision.action in DISRUPTIVE_ACTIONS:
                self.engine._budget.release(decision_id)
                preempted.append(decision_id)
        return preempted

    def _dispatch_stop(self, d: Decision) -> None:
        apply_at = max(self.step_of.values(), default=0)
        self._seq += 1
        cmd = Command(
            d.decision_id + "-stop",
            "abort",
            dict(d.params),
            apply_at,
            d.anomaly.step,
            apply_at_tick=self._tick(),
            seq=self._seq,
        )
        self.pending[cmd.decision_id] = _Pending(d, cmd, set(range(self.world_size)), self.now)

    def _resolve_now(self, d: Decision, outcome: str, detail: str) -> None:
        self._journal(d, outcome, detail=detail)
        if outcome in ("applied", "failed"):
            self.handle(
                self.engine.record_outcome(d.decision_id, outcome, tick=self._tick(), detail=detail)
            )

    def _tick(self) -> int:
        return max(self.tick_of.values(), default=0)

    # -------------------------------------------------------------- outcomes
    def _close(self, decision_id: str) -> None:
        """Take a command off the pending list; outcomes still on their way are then late, not invalid."""
        del self.pending[decision_id]
        self._closed.add(decision_id)
        self._recent_closed.append(decision_id)
        self.changes += 1

    def _outcome(self, outcome: Outcome) -> None:
        pending = self.pending.get(outcome.decision_id)
        if pending is None or outcome.rank not in pending.targets:
            # A rank may still report a step of a chain that was dropped, or a
            # command resolved without it; an id never issued is bad input.
            if outcome.decision_id not in self._closed:
                self.rejected["outcome_unknown_decision"] += 1
            return
        # An outcome alone moves no state record (at 256 ranks that was one per
        # outcome): lost in a crash, it is asked for again, as the restored
        # command is still owed by that rank, which re-sends a done command's
        # outcome. Closing the command does (`_close`).
        pending.outcomes[outcome.rank] = outcome
        # Outcomes come only from targets (checked above), so every target has answered
        # when there are as many: no pass over every rank per outcome (at 4,096 ranks a
        # command's outcomes cost O(ranks^2) that way).
        complete = len(pending.outcomes) >= len(pending.targets)
        if _internal(pending.command.decision_id):
            if complete:
                self._close(outcome.decision_id)
            return
        failed = (
            [o for o in pending.outcomes.values() if o.outcome != "applied"]
            if complete or outcome.outcome != "applied"
            else []
        )
        if failed or complete:
            self._resolve(pending, failed)

    def _resolve(self, pending: _Pending, failed: list[Outcome]) -> None:
        self._close(pending.decision.decision_id)
        d = pending.decision
        first = next(iter(failed), None) or pending.outcomes[min(pending.outcomes)]
        outcome = "failed" if failed else "applied"
        self._emit(
            HistoryRecord({"type": "resolved", "decision_id": d.decision_id, "outcome": outcome})
        )
        follow = self.engine.record_outcome(
            d.decision_id, outcome, tick=self._tick(), detail=first.detail
        )
        journal_outcome = "escalated" if failed and follow else outcome
        self._journal(
            d,
            journal_outcome,
            detail=first.detail,
            result=first.result,
            applied_at_step=first.step,
            apply_at_step=pending.command.apply_at_step,
            latency_s=round(self.now - pending.dispatched_at, 4),
            attempts=first.attempts,
        )
        if failed and d.ends_chain_on_failure:
            self._drop_rest_of_chain(d)
        self.handle(follow)
        if d.action == "replay_step" and not failed:
            self._answer_replay(pending, first)

    def _answer_replay(self, pending: _Pending, outcome: Outcome) -> None:
        """A replay's classification goes to the policy; then every rank gets the answer.

        The ranks classified together and hold at their boundary until this answer
        (`workers.replay`): a `<decision>-answer` command sent after what the policy
        decided about the classification, naming it, and the ranks a restart replaces
        (the survivors then wait for the group to re-form).
        """
        d = pending.decision
        ev = replay_event(outcome.result.get("verdict"), self._tick(), self.now, d)
        deferred = set(self.deferred)
        decided: list[Decision] = []
        if ev is not None:
            self._record(ev)
            decided = self.engine.decide([self._stamped(ev)], now=self.now)
            self.handle(decided)
        restarts = [
            x for i, x in self.deferred.items() if i not in deferred and x.action == "restart_rank"
        ]
        answer = {
            "classification": ev.kind if ev is not None else None,
            "actions": [
                {"action": x.action, "rule": x.rule, "ranks": list(x.ranks)}
                for x in decided
                if not (x.suppressed or x.dry_run)
            ],
            "restart": sorted({r for x in restarts for r in x.ranks}),
        }
        self._seq += 1
        cmd = Command(
            d.decision_id + "-answer",
            "replay_step",
            {"answer": answer},
            max(self.step_of.values(), default=0),
            d.anomaly.step,
            apply_at_tick=self._tick(),
            seq=self._seq,
        )
        self.pending[cmd.decision_id] = _Pending(d, cmd, set(pending.targets), self.now)
        self.changes += 1

    def _drop_rest_of_chain(self, failed: Decision) -> None:
        """A failed step ends its chain: later steps are not carried out (the engine says so too)."""
        for pending in list(self.pending.values()):
            later = pending.decision
            if later.chain_id == failed.chain_id and later.chain_index > failed.chain_index:
                self._close(later.decision_id)
                step = failed.chain_index + 1
                self._journal(
                    later, "suppressed", detail=f"not run: step {step} of the chain failed"
                )

    def advance_command_seq(self, seq: int) -> None:
        """Number new commands above `seq` (what a rank holds already: a supervisor that lost
        its journal; ranks take a command at or below the seq they agree on as agreed)."""
        self._seq = max(self._seq, seq)

    def finish(self, reason: str = "the run ended before the ranks reported an outcome") -> None:
        """Resolve every decision still pending as failed (nothing is lost from the journal)."""
        held = self.incidents.flush()
        if held:
            self.handle(self.engine.decide(held, now=self.now))
        for pending in list(self.pending.values()):
            self._close(pending.command.decision_id)
            if _internal(pending.command.decision_id):
                continue
            self._journal(
                pending.decision,
                "failed",
                detail=reason,
                apply_at_step=pending.command.apply_at_step,
            )

    def _journal(self, d: Decision, outcome: str, *, detail: str = "", **extra: Any) -> None:
        record = decision_record(d, outcome, detail=detail, **extra)
        if d.decision_id in self._journaled:
            return  # journaled before a supervisor restart; its outcome came again
        self._journaled.add(d.decision_id)
        self.changes += 1
        self.decisions.append(record)
        self.outcome_counts[outcome] += 1
        if outcome == "applied":
            self.action_counts[d.action] += 1
        self._emit(DecisionRecord(record))

    def _emit(self, effect: Effect) -> None:
        if self.journal or not isinstance(effect, Journal):
            self.effects.append(effect)

    def take_effects(self) -> list[Effect]:
        """What the shell is to carry out, in order, since the last call (then forgotten)."""
        out, self.effects = self.effects, []
        return out

    def _at(self, now: float | None) -> float:
        """The time an input told (`now`), kept as the controller's; None: the last one."""
        if now is not None:
            self.now = now
            if self._started is None:
                self._started = now
        return self.now

    # ---------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """The state record a restarted supervisor resumes from (`control_state.dump`)."""
        return control_state.dump(self)

    def load_state_dict(self, state: dict[str, Any], now: float | None = None) -> None:
        """Resume from a `state_dict`; the policy must be the one it was taken under. `now`:
        the time of the restore (held incidents wait afresh from it)."""
        self._at(now)
        control_state.load(self, state)

    def restore_decisions(self, records: Iterable[dict[str, Any]]) -> None:
        """The lines of decisions.jsonl written before a restart: kept, and never written again.

        The outcome and action counts are the journal's, recounted from these lines
        (a line written after the last state record counts too).
        """
        self.outcome_counts, self.action_counts = Counter(), Counter()
        for record in records:
            decision_id = record.get("decision_id")
            if not isinstance(decision_id, str) or decision_id in self._journaled:
                continue
            self._journaled.add(decision_id)
            self.decisions.append(record)
            outcome = str(record.get("outcome"))
            self.outcome_counts[outcome] += 1
            if outcome == "applied":
                self.action_counts[str(record.get("action"))] += 1

    def final_loss(self, rank: int = 0) -> float | None:
        losses = self.recent_loss.get(rank)
        return sum(losses) / len(losses) if losses else None


def replay_event(verdict: Any, tick: int, now: float, d: Decision) -> AnomalyEvent | None:
    """The anomaly a replay's classification is (`workers.replay.classify`), or None if the
    ranks' result does not hold one. Checked like any event from a rank."""
    if not isinstance(verdict, dict):
        return None
    details = {
        "reason": verdict.get("reason"),
        "replay_decision": d.decision_id,
        "anomaly": {"kind": d.anomaly.kind, "rank": d.anomaly.rank, "step": d.anomaly.step},
        "replay_s": verdict.get("replay_s"),
        "evidence": verdict.get("evidence"),
    }
    raw = {
        "kind": verdict.get("kind"),
        "rank": verdict.get("rank"),
        "step": verdict.get("step"),
        "tick": tick,
        "severity": "warning" if verdict.get("kind") == "replay_reproducible" else "critical",
        "ts": now,
        "details": details,
    }
    try:
        return AnomalyEvent.from_dict(raw)
    except EventError as exc:
        log.warning("replay_verdict_rejected", error=str(exc))
        return None


def decision_record(d: Decision, outcome: str, *, detail: str = "", **extra: Any) -> dict[str, Any]:
    """The `decisions.jsonl` line of decision `d` with its `outcome`."""
    return {
        "decision_id": d.decision_id,
        "step": d.step,
        "ranks": list(d.ranks),
        "rule": d.rule,
        "anomaly": d.anomaly.to_dict(),
        "action": d.action,
        "params": dict(d.params),
        "outcome": outcome,
        "reason": d.reason,
        "detail": detail,
        "chain": {"id": d.chain_id, "index": d.chain_index, "length": d.chain_length},
        **extra,
    }
