"""What a node agent does with its ranks' reports, without Ray: a plain object a test can step.

A node agent (`supervisor.agent`) stands between the ranks of one node and
the supervisor. Per rank report it does the work the supervisor did for
every rank before: the run's token, the rank's slot (incarnation and batch
number, deduplicated by (rank, incarnation, seq)), validation of every item
(`report_validation`), and the metrics file. What goes upward is much less:

- an *immediate item* for a batch that carries anomaly events, sent at once
  and awaited before the rank gets its answer, so the rank's reporter keeps
  the batch (and sends it again) until the supervisor has it; and for a batch
  of a rank `holding` at a flagged step's boundary (`workers.flag_hold`),
  which waits for the supervisor to have every rank's report of that step;
  and for a batch that says its rank's collective failed (`collective_failed`),
  on which the supervisor looks for the lost peer at once;
- one *digest* per interval, one item per rank that reported meanwhile: its
  newest step and tick, its median compute time over the interval (the
  straggler watch's input), its newest loss, its outcomes, and every batch
  number it covers. The lead rank's step records (rank 0, whose records the
  goodput ledger counts) go up in full.

Outcomes ride the digest rather than a call of their own: every command goes
to every rank, so one decision brings an outcome from each rank, and sent at
once they would cost the supervisor one call per rank per decision again. A
batch with outcomes is answered only once the digest that carries them is
acknowledged (`Taken.held`), so they are never acknowledged to the rank
before the supervisor has them.

Every item carries the batch numbers (`seqs`) it stands for, so the
supervisor's own rank slots still see every number exactly once: a call that
Ray retried, or a batch a restarted agent took again, is a duplicate there.
Commands come back per rank in each reply and are kept until the next one;
a rank's report is answered with the commands kept for it.

The agent's hang watch (`watch`, the supervisor's `HangWatch` over this
node's ranks) moves with each report taken; `ping_due` paces the agent's
ping rounds and `sightings` turns a round's answers into what goes upward
(`supervisor.core.sightings`).

`record()` is the agent's small state record (slots and each rank's last
step and tick), from which a restarted agent rebuilds itself (`restore`):
its ranks' batch numbers (a retried call is a duplicate here already) and
where each rank's next report is measured from.
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from remedy.control.hang_watch import DEAD, HangWatch, HangWatchConfig, step_times
from remedy.control.sightings import AGENT_PING_EVERY_S, RECOVERING_QUIET_S, sighting_items
from remedy.control.slots import RankSlots, Slot, SlotState, unanswered_from
from remedy.protocol import phases
from remedy.protocol.phases import IN_LOOP, IN_RECOVERY
from remedy.protocol.reports import Limits, RankMark, Report, validate_batch

# Keys of a step record the supervisor reads (controller, goodput, displays); the rest
# stays in the agent's metrics file.
UPWARD_METRIC_KEYS = ("step", "tick", "rank", "loss", "step_time_s", "loader_time_s", "t_end")
# The time a step waited (in collectives, for a peer's phase): the lead rank's records keep
# them, so the straggler watch compares its compute time with the others', not its wall time.
WAIT_KEYS = ("collective_s", "phase_wait_s")
# The rank whose every step record the goodput ledger counts (`GoodputLedger.lead`).
LEAD_RANK = 0
_LIMITS = Limits()
# A rank's pace is the median gap between its latest reports here, this many of them.
PACE_REPORTS = 9
# The longest digest period a node's slow-reporting ranks set (`AgentCore.digest_interval`):
# commands reach a rank within a digest period plus its own report interval.
DIGEST_MAX_S = 2.0


def paced_period(floor: float, pace: float | None) -> float:
    """A digest period of at least `floor`, and no shorter than `pace`, the time the node's
    ranks take between reports (None: not known yet), up to `DIGEST_MAX_S`."""
    return floor if pace is None else max(floor, min(pace, DIGEST_MAX_S))


@dataclass
class _Pending:
    """What one rank reported since its last item went up (metrics-only batches)."""

    header: dict[str, Any]
    seqs: list[int] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    outcomes: list[dict[str, Any]] = field(default_factory=list)
    outages: list[Any] = field(default_factory=list)
    ending: bool = False
    # The highest `unanswered_from` of the batches merged (`supervisor.reporter`).
    unanswered_from: int | None = None


@dataclass(frozen=True, slots=True)
class Taken:
    """What became of one rank report at the agent.

    `ok`: the batch counts (False: refused, or a duplicate); `item`: the
    immediate item to send upward before answering, if the batch carried
    events or holds; `duplicate`: seen already (answer with the kept commands);
    `held`: the batch carried outcomes, which go up with the next digest: answer
    it once that digest is acknowledged; `holding`: the flagged tick the rank
    holds for (its answer says whether the supervisor has settled it); `hurry`:
    the rank's first report in a new generation of its group, which a restart
    waits on: the next digest goes now, not at the end of the period.
    """

    ok: bool
    item: dict[str, Any] | None = None
    duplicate: bool = False
    held: bool = False
    metrics: tuple[dict[str, Any], ...] = ()
    holding: int | None = None
    hurry: bool = False
    final: bool = False  # holding at its last step: nothing may be owed (rank.link.end_hold)


class AgentCore:
    """One node's share of the supervisor's per-report work."""

    def __init__(
        self,
        *,
        node: str,
        token: str,
        world_size: int,
        clock: Callable[[], float] = time.time,
        hang_watch: HangWatchConfig | None = None,
    ) -> None:
        self.node = node
        self._token = token.encode()
        self.world_size = world_size
        self._clock = clock
        self.rejected: Counter[str] = Counter()
        self.slots = RankSlots(0, rejected=self.rejected)
        self._marks: dict[int, RankMark] = {}
        self._tick_counts: dict[int, dict[int, int]] = {}
        self._pending: dict[int, _Pending] = {}
        self._commands: dict[int, list[dict[str, Any]]] = {}
        self.taken = 0  # batches counted
        # Per rank, the batch numbers taken that the supervisor has not acknowledged yet: the
        # state record counts them as not taken (`record`), so that when Ray retries their
        # calls against a restarted agent, it takes them again and sends them on.
        self._unsent: dict[int, set[int]] = {}
        self.changed = False  # slots moved since the last `record()`
        # The supervisor's hang watch over this node's ranks, on this object's clock, fed by
        # each report as it comes (`supervisor.core.sightings`: the agent pings when it suspects).
        self.watch = HangWatch(hang_watch)
        self.suspected_at = 0.0  # when the current stall was first suspected (0: none)
        # Per rank, when its latest reports were taken (this clock): its pace (`report_period`).
        self._arrivals: dict[int, deque[float]] = {}
        self._next_ping = 0.0
        self._round_at = 0.0  # when the latest ping round was found due (this clock)

    # ------------------------------------------------------------- reports
    def take(self, batch: Any) -> Taken:
        """One rank report in: checked, validated and kept for the digest (or sent at once)."""
        if not isinstance(batch, dict):
            self.rejected["batch_not_a_mapping"] += 1
            return Taken(False)
        if not self._authorized(batch.pop("token", None)):
            return Taken(False)
        rank, incarnation, seq = batch.get("rank"), batch.get("incarnation"), batch.get("seq")
        if type(rank) is not int or not 0 <= rank < self.world_size:
            self.rejected["batch_rank"] += 1
            return Taken(False)
        below = unanswered_from(seq, batch.get("unanswered_from"))
        if type(incarnation) is int:
            self._open(rank, incarnation, below if type(seq) is int else None)
        duplicates = self.slots.refused_duplicate
        if not self.slots.accept(rank, incarnation, seq, time.monotonic()):
            return Taken(False, duplicate=self.slots.refused_duplicate > duplicates)
        self.slots.answered_below(rank, seq, batch.get("unanswered_from"))  # a bad one counted
        unsent = self._unsent.get(rank)
        if below is not None and unsent:
            # Answered at the rank: never retried, so a restarted agent need not take it again
            # (an item that failed upward leaves its numbers here; they must not pile up).
            unsent.difference_update([q for q in unsent if q < below])
        now = self._clock()
        last = self._marks.get(rank)
        if last is None:
            # A rank's first report here is measured from itself: only the supervisor knows
            # how far the run has come (a resumed run starts far from step 0), and checks it.
            last = _first_mark(batch, now)
        report = validate_batch(
            batch,
            world_size=self.world_size,
            last=last,
            origin=None,
            now=now,
            limits=_LIMITS,
            rejected=self.rejected,
            tick_counts=self._tick_counts.get(rank),
        )
        if report is None:
            return Taken(False)
        self.taken += 1
        self.changed = True
        self._tick_counts[rank] = report.tick_counts
        if report.tick > last.tick:
            self.watch.settle(rank)  # it moved: a recovery's quiet time (`sightings`) is over
        self._marks[rank] = RankMark(report.step, report.tick, now)
        self._arrivals.setdefault(rank, deque(maxlen=PACE_REPORTS)).append(now)
        self._beat(report, batch, now)
        self._merge(report, incarnation, seq, below, batch)
        holding = batch.get("holding")
        holding = holding if type(holding) is int and 0 <= holding < 2**53 else None
        # A rank whose collective failed goes up at once: the supervisor pings the group.
        failed = batch.get("collective_failed") is True
        if failed:
            # This node's ranks are pinged at once, and the round's sightings go up: the
            # supervisor then pings only the ranks no agent answered for (a lost node's).
            self.watch.alarm(now)
            self._next_ping = 0.0
        if report.events or holding is not None or failed:
            item = self._item(self._pending.pop(rank))
            item["events"] = [ev.to_dict() for ev in report.events]
            if failed:
                item["collective_failed"] = True
            final = holding is not None and batch.get("final") is True
            return Taken(True, item, metrics=tuple(report.metrics), holding=holding, final=final)
        return Taken(
            True,
            metrics=tuple(report.metrics),
            held=bool(report.outcomes),
            hurry=batch.get("regrouped") is True,
        )

    def _beat(self, report: Report, batch: dict[str, Any], now: float) -> None:
        """The hang watch sees the report as the supervisor's does without agents."""
        if batch.get("ending") is True:
            self.watch.forget(report.rank)  # its loop is done: no progress to wait for
            return
        self.watch.beat(report.rank, report.tick, now, step_times(report.metrics))

    def incarnation(self, rank: int) -> int:
        """The incarnation of `rank` this agent follows (0 for a rank it has not seen)."""
        slot = self.slots.slots.get(rank)
        return slot.incarnation if slot is not None else 0

    def _authorized(self, token: Any) -> bool:
        if isinstance(token, str) and secrets.compare_digest(
            token.encode("utf-8", "replace"), self._token
        ):
            return True
        self.rejected["token"] += 1
        return False

    def _open(self, rank: int, incarnation: int, below: int | None = None) -> None:
        """A slot for `rank` on its first report, a fresh one for a newer incarnation.

        The supervisor owns incarnations; the agent follows the highest it has
        seen, so a replaced process's late batches are refused here already. A
        rank that reported to the supervisor before it found this agent (its node
        joined the run) comes with batch numbers already answered: its slot starts
        below its lowest unanswered one (`below`), which is all this agent will ever get.
        """
        slot = self.slots.slots.get(rank)
        if slot is None:
            self.slots.slots[rank] = Slot(
                rank, incarnation, last_seq=max((below or 1) - 1, 0), last_at=time.monotonic()
            )
            self.watch.started(rank, self._clock())
        elif incarnation > slot.incarnation:
            self.slots.slots[rank] = Slot(rank, incarnation, last_at=time.monotonic())
            self.watch.started(rank, self._clock())
            self._marks.pop(rank, None)
            self._tick_counts.pop(rank, None)
            self._pending.pop(rank, None)
            self._unsent.pop(rank, None)

    def _merge(
        self, report: Report, incarnation: Any, seq: Any, below: int | None, batch: dict[str, Any]
    ) -> _Pending:
        """Fold a valid report into the rank's pending item (newest header, every seq, the
        highest `unanswered_from`: `below`, checked already)."""
        header: dict[str, Any] = {
            "rank": report.rank,
            "step": report.step,
            "tick": report.tick,
            "ts": batch.get("ts"),
        }
        if type(incarnation) is int:
            header["incarnation"] = incarnation
        if report.max_steps is not None:
            header["max_steps"] = report.max_steps
        if report.batch_size is not None:
            header["batch_size"] = report.batch_size
        pending = self._pending.get(report.rank)
        if pending is None:
            pending = self._pending[report.rank] = _Pending(header)
        elif report.tick >= pending.header["tick"]:
            # The newest by tick, not by arrival: calls Ray retries after a restart come in
            # any order, and an item's records may not be ahead of its header.
            pending.header = header
        if type(seq) is int:
            pending.seqs.append(seq)
            self._unsent.setdefault(report.rank, set()).add(seq)
        if below is not None:
            pending.unanswered_from = max(below, pending.unanswered_from or 0)
        pending.metrics.extend(report.metrics)
        pending.outcomes.extend(o.to_dict() for o in report.outcomes)
        if isinstance(batch.get("outages"), list):
            pending.outages.extend(batch["outages"])
        pending.ending = pending.ending or batch.get("ending") is True
        return pending

    def _item(self, pending: _Pending) -> dict[str, Any]:
        """The upward item of one rank: header, batch numbers, digested metrics."""
        item: dict[str, Any] = {
            **pending.header,
            "seqs": list(pending.seqs),
            "events": [],
            "outcomes": list(pending.outcomes),
            "metrics": digest_metrics(pending.header["rank"], pending.metrics),
        }
        if pending.outages:
            item["outages"] = list(pending.outages)
        if pending.ending:
            item["ending"] = True
        if pending.unanswered_from is not None:
            item["unanswered_from"] = pending.unanswered_from
        return item

    def report_period(self) -> float | None:
        """How long this node's ranks take between reports: per rank the median gap between
        its latest reports here, the median over its ranks (None before one reported thrice).
        An anomaly's batch goes out early and shortens one gap; the medians pass over it."""
        paces = []
        for times in self._arrivals.values():
            if len(times) >= 3:
                paces.append(statistics.median(b - a for a, b in pairwise(times)))
        return statistics.median(paces) if paces else None

    def digest_interval(self, floor: float) -> float:
        """The time to the next digest: `floor` (the run's `agent.digest_period`), or as long
        as this node's ranks take between reports, up to `DIGEST_MAX_S`.

        A digest sent more often than the ranks report carries fewer reports than the
        node has ranks, and the supervisor's cost is mostly per call, whatever it carries:
        at one report per rank a second, 0.5 s digests cost it twice the calls of 1 s ones
        for the same reports. Anomalies, a held rank's batch, a failed collective and hang
        sightings go up at once; what waits up to a period longer is an action's outcomes,
        the supervisor's view of progress, and a command's way down (which a rank picks up
        only at its next report anyway).
        """
        return paced_period(floor, self.report_period())

    def digest(self) -> list[dict[str, Any]]:
        """One item per rank that reported since the last digest; empties the pending set."""
        items = [self._item(p) for p in self._pending.values()]
        self._pending.clear()
        return items

    def delivered(self, items: list[dict[str, Any]]) -> None:
        """The supervisor acknowledged `items` (a digest or an immediate item): its numbers
        are no longer at risk if this agent dies."""
        for item in items:
            unsent = self._unsent.get(item["rank"])
            if unsent is not None:
                unsent.difference_update(item["seqs"])

    def put_back(self, items: list[dict[str, Any]]) -> None:
        """A digest whose call failed: its items go out again with the next one.

        An item Ray delivered after all is a duplicate at the supervisor by its
        batch numbers; its metrics are digests, counted once by the ledger.
        """
        for item in items:
            rank = item["rank"]
            newer = self._pending.get(rank)
            header = {k: v for k, v in item.items() if k not in _BODY}
            back = _Pending(header, list(item["seqs"]), [], list(item.get("outages", [])))
            back.ending = bool(item.get("ending"))
            back.metrics = list(item["metrics"])
            back.outcomes = list(item["outcomes"])
            back.unanswered_from = item.get("unanswered_from")
            if newer is not None:
                back.header = newer.header
                back.seqs += newer.seqs
                back.metrics += newer.metrics
                back.outcomes += newer.outcomes
                back.outages += newer.outages
                back.ending = back.ending or newer.ending
                back.unanswered_from = max(
                    (b for b in (back.unanswered_from, newer.unanswered_from) if b is not None),
                    default=None,
                )
            self._pending[rank] = back

    # ------------------------------------------------------------ commands
    def answered(self, replies: dict[Any, Any]) -> None:
        """The supervisor's reply: the commands each rank in it still owes."""
        for rank, commands in replies.items():
            if isinstance(commands, list):
                self._commands[int(rank)] = commands

    def commands(self, rank: int) -> list[dict[str, Any]]:
        """The commands kept for `rank` (each a copy: a rank's Guard may keep it)."""
        return [dict(c) for c in self._commands.get(rank, [])]

    @property
    def ranks(self) -> list[int]:
        """Ranks that reported to this agent (current incarnations)."""
        return sorted(self.slots.slots)

    # --------------------------------------------------------------- hangs
    def watched(self) -> list[int]:
        """The ranks this agent's hang watch follows (reported here, not ended or gone)."""
        return [r for r in self.ranks if self.watch.knows(r)]

    def ping_due(self) -> bool:
        """Whether to ping this node's ranks now: a rank is suspect, and the last round is
        `AGENT_PING_EVERY_S` old."""
        now = self._clock()
        if not self.watch.suspects(now):
            self.suspected_at = 0.0
            self.watch.clear_alarm(now)  # every rank moved since: nothing is left to look for
            return False
        self.suspected_at = self.suspected_at or now
        if now < self._next_ping:
            return False
        self._next_ping = now + AGENT_PING_EVERY_S
        self._round_at = now
        return True

    def sightings(self, pings: dict[int, Any], pinged_at: float) -> list[dict[str, Any]]:
        """One ping round's answers in: the watch moved by them, the sightings to send up.

        An answer from inside the rank's loop says how far it got (progress its
        Guard has not reported yet ends the suspicion). A rank whose actor is gone
        is reported once and no longer watched: its replacement, wherever it runs,
        reports as a new incarnation. A rank in its group's recovery (`recovering`, `joining`)
        goes up in this round's sightings as it is (the round after a failed
        collective's alarm needs them), then is not pinged for `RECOVERING_QUIET_S`.
        """
        now = self._clock()
        for rank, p in pings.items():
            self.watch.answered(rank, p, now)
        items = sighting_items(
            self.watch,
            pings,
            {r: self.incarnation(r) for r in pings},
            now=now,
            suspected_at=self.suspected_at,
            pinged_at=pinged_at,
        )
        for rank, p in pings.items():
            if p == DEAD:
                self.watch.forget(rank)
            elif phases.of(p) in IN_RECOVERY:
                self.watch.allow(rank, RECOVERING_QUIET_S, now)
            elif phases.of(p) in IN_LOOP:
                self.watch.settle(rank)  # back in its loop: watched by its step time again
        self.watch.clear_alarm(self._round_at)  # a failed collective's alarm: answered
        return items

    def replaced(self, rank: int) -> None:
        """The supervisor follows a newer process of `rank` than this agent's: stop watching it."""
        self.watch.forget(rank)
        self._arrivals.pop(rank, None)

    # --------------------------------------------------------------- record
    def record(self) -> dict[str, Any]:
        """The state record a restarted agent rebuilds from (`from_record`)."""
        self.changed = False
        slots = self.slots.records()
        for r in slots:  # a number not acknowledged upward counts as not taken
            r["gaps"] = sorted({*r["gaps"], *self._unsent.get(r["rank"], ())})
        return {
            "node": self.node,
            "slots": slots,
            "marks": {str(r): [m.step, m.tick] for r, m in self._marks.items()},
        }

    def restore(self, record: dict[str, Any]) -> None:
        """Take back the slots and marks of `record` (an earlier life of this agent)."""
        now = self._clock()
        for r in record.get("slots", []):
            rank = int(r["rank"])
            slot = Slot(rank, int(r["incarnation"]), SlotState(r["state"]), int(r["last_seq"]))
            slot.gaps = {int(q) for q in r.get("gaps", [])}
            slot.last_at = time.monotonic()
            self.slots.slots[rank] = slot
        for rank, (step, tick) in record.get("marks", {}).items():
            self._marks[int(rank)] = RankMark(int(step), int(tick), now)
            self.watch.beat(int(rank), int(tick), now)  # watched from its last known tick


def _first_mark(batch: dict[str, Any], now: float) -> RankMark:
    """Where a rank's first batch at this agent is measured from: its own header."""
    step, tick = batch.get("step"), batch.get("tick", batch.get("step"))
    return RankMark(step if type(step) is int else 0, tick if type(tick) is int else 0, now)


_BODY = frozenset({"seqs", "events", "outcomes", "metrics", "outages", "ending", "unanswered_from"})


def digest_metrics(rank: int, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the supervisor needs of a rank's step records since its last item.

    The lead rank's go up in full (the goodput ledger counts each of its
    steps), trimmed to the keys the supervisor reads. Any other rank's become
    one record: the newest, with `step_time_s` the median compute time
    (step time less time in collectives) over them, as the straggler watch
    compares ranks by.
    """
    if not records:
        return []
    if rank == LEAD_RANK:
        keys = (*UPWARD_METRIC_KEYS, *WAIT_KEYS)
        return [{k: m[k] for k in keys if k in m} for m in records]
    newest = {k: records[-1][k] for k in UPWARD_METRIC_KEYS if k in records[-1]}
    compute = [c for c in (_compute_s(m) for m in records) if c is not None]
    if compute:
        newest["step_time_s"] = statistics.median(compute)
    else:
        newest.pop("step_time_s", None)
    return [newest]


def _compute_s(record: dict[str, Any]) -> float | None:
    """A record's compute time: step time less time waited in collectives or for a peer's
    phase (the larger: the collectives hold the wait for the peer when they were timed)."""
    seconds = record.get("step_time_s")
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return None
    waits = [
        float(w)
        for w in (record.get(k) for k in WAIT_KEYS)
        if isinstance(w, int | float) and not isinstance(w, bool)
    ]
    return max(float(seconds) - max(waits), 0.0) if waits else float(seconds)
