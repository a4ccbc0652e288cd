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

Its parts, each a module of functions over the Controller's state: the book
of pending commands and their outcomes (`command_book`), the answer to a
replay (`replay_answer`), a rewind of every rank and a lost rank
(`rewind`), the decisions journaled (`decision_journal`), and its state
record (`decide_state`). Here: the intake of a batch and the dispatch of
decisions. It calls nothing of its shell: what the shell must do leaves as
effects (`take_effects`), and the time comes with the inputs.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from remedy.control import command_book as book
from remedy.control import decide_state as control_state
from remedy.control import decision_journal, rewind
from remedy.control.command_book import INTERNAL_SUFFIXES as INTERNAL_SUFFIXES
from remedy.control.command_book import Outcomes as Outcomes
from remedy.control.command_book import Pending
from remedy.control.command_book import outcome_key as outcome_key
from remedy.control.decision_journal import decision_record as decision_record
from remedy.control.decision_journal import journal
from remedy.control.effects import (
    AnomalyRecord,
    Effect,
    GroupAction,
    HistoryRecord,
    Journal,
    MetricRecords,
    Notify,
    log_notify,
)
from remedy.control.goodput import STALLING_ACTIONS, GoodputLedger
from remedy.control.replay_answer import replay_event as replay_event
from remedy.control.straggler import StepTimes, StragglerWatch
from remedy.policies import SUPERVISOR_ACTIONS, AnomalyEvent, Decision, Engine, IncidentMerger
from remedy.protocol.reports import Limits, RankMark, Report, validate_batch

log = structlog.get_logger("remedy.control")

DEFAULT_LIMITS = Limits()


class _Default(enum.Enum):
    """Marks an argument left out, where `None` means "off"."""

    TOKEN = 0


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
        self.pending: dict[str, Pending] = {}  # the book of commands (`command_book`)
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
            book.take_outcome(self, outcome)
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
        """The commands each of `ranks` still owes, for one reply (`command_book.owed`)."""
        return book.owed(self, ranks)

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
                journal(self, d, "suppressed")
            elif d.dry_run:
                journal(self, d, "dry_run")
            elif d.action in SUPERVISOR_ACTIONS:
                self._supervisor_action(d)
            else:
                book.dispatch(self, d)

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
            book.dispatch_stop(self, d)
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
        book.dispatch(self, d)
        book.dispatch_stop(self, d)
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
        journal(self, d, outcome, detail=detail, **extra)
        self.handle(
            self.engine.record_outcome(decision_id, outcome, tick=self._tick(), detail=detail)
        )

    def resolve_notify(self, decision_id: str, outcome: str, detail: str) -> None:
        """The shell's answer to a `Notify`: how sending it went ("applied", "failed")."""
        self._resolve_now(self.notifying.pop(decision_id), outcome, detail)

    def rewound(self, tick: int, resumed: str) -> list[str]:
        """Every rank restarted from tick `tick`: the pending rewinds it carried out are
        settled (`rewind.rewound`). Returns the decisions settled."""
        return rewind.rewound(self, tick, resumed)

    def drop_rank(self, rank: int) -> list[str]:
        """A rank was lost: it leaves the targets of every pending command
        (`rewind.drop_rank`). Returns the pre-empted decision ids."""
        return rewind.drop_rank(self, rank)

    def _resolve_now(self, d: Decision, outcome: str, detail: str) -> None:
        journal(self, d, outcome, detail=detail)
        if outcome in ("applied", "failed"):
            self.handle(
                self.engine.record_outcome(d.decision_id, outcome, tick=self._tick(), detail=detail)
            )

    def _tick(self) -> int:
        return max(self.tick_of.values(), default=0)

    # ------------------------------------------------------------- commands
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
            book.close(self, pending.command.decision_id)
            if book.internal(pending.command.decision_id):
                continue
            journal(
                self,
                pending.decision,
                "failed",
                detail=reason,
                apply_at_step=pending.command.apply_at_step,
            )

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
        """The lines of decisions.jsonl written before a restart: kept, never written again
        (`decision_journal.restore_decisions`)."""
        decision_journal.restore_decisions(self, records)

    def final_loss(self, rank: int = 0) -> float | None:
        losses = self.recent_loss.get(rank)
        return sum(losses) / len(losses) if losses else None
