"""True goodput: which executed steps were kept, and where the wall time went.

A rollback, a full-group restart from a checkpoint, a replacement that
redoes steps: each executes steps whose result is then thrown away. Ticks
cannot count them (a process resumed from a checkpoint takes the
checkpoint's tick), so the ledger counts executions itself, from the lead
rank's metrics records (rank 0, whatever its incarnation), in the order they
were run:

- a record whose step is below the timeline's end is a rewind: the steps
  from it to the end were executed and discarded; their time is lost to the
  rewind's cause (the anomaly of the rollback decided, or of the loss that
  led to a full-group restart, `expect_rewind`);
- a record past the end means steps ran whose records never came (the lead's
  process was killed before reporting them): they count as executed and kept,
  with the typical step time;
- the wall time between two records with no step running is idle: a stall
  when it precedes a rewound record, or is the first idle span to end after
  a rank loss or a restart was found (`disrupted`: detection, restart,
  restore, regroup, all of it the loss's), or holds the moment a restarted
  supervisor came back (`outage`) with no rank loss in it; else per-step
  overhead (snapshots, checkpoints, commands).

The wall time is a partition: a record's time is counted only from the end
of the one before (records that overlap count once), steps whose records
never came are fitted into the gap they ran in, and every other second is
startup, shutdown, a stall or overhead. So the rows and the kept time sum
to the wall time and none is negative (`summary`).

Step goodput is steps kept / steps executed; time goodput (ETTR, effective
training time ratio) is the time of the kept steps' last executions over the
wall time. `summary` lists the rest of the wall time by what it went to and
which anomaly caused it. The same ledger is fed live by the Controller and
rebuilt from the run directory (`replay`) by a restarted supervisor or for a
run without a summary.
"""

from __future__ import annotations

import bisect
import math
import statistics
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

# A rewind whose cause the ledger was not told (a rewind by an action it does not know).
UNATTRIBUTED = "unattributed"
# The cause of an idle span around a supervisor's return (`GoodputLedger.outage`).
SUPERVISOR_RESTART = "supervisor_restart"
# Recent (tick, end time) pairs of the lead, to drop a record seen twice (a batch re-sent
# to a restarted supervisor that had written it already).
SEEN_KEPT = 1024
# Step times kept for the typical step time of records that never came.
RECENT_KEPT = 64
# Actions whose application sends the ranks back to an earlier step: a rollback, and a
# replay_step (the ranks re-run the step from the state before it and wait at that boundary,
# so the steps they trained while the replay command was on its way are discarded).
REWINDING_ACTIONS = frozenset({"rollback", "replay_step"})
# The supervisor's anomalies of a rank lost (`control.lost_ranks`): each stops the group, as
# the live ledger is told (`GoodputLedger.disrupted`); its other ones (a straggler) stop nothing.
LOSSES = frozenset({"rank_hang", "rank_dead", "node_lost"})
# Actions that stop the group until they end (a rank replaced, the group re-formed): the
# stall they cause is their anomaly's, whatever found it (`GoodputLedger.disrupted`).
STALLING_ACTIONS = frozenset({"restart_rank"})
# A record that ended this long before the newest one seen ran before it: it arrives late
# (re-sent to a restarted supervisor after newer ones), and its step was counted as unreported
# when the newer record came; it is no rewind.
LATE_S = 1e-3


class GoodputLedger:
    """The lead rank's timeline of executed steps, and the time lost around it."""

    def __init__(self, lead: int = 0) -> None:
        self.lead = lead
        # Seconds of the latest execution of each step of the timeline (the typical step
        # time for one whose record never came), and 1 where its update was dropped.
        self._dur = array("d")
        self._skipped = bytearray()
        self._skip_cause: dict[int, str] = {}  # step -> anomaly kind, for skipped updates
        # Running totals over the timeline, so the live gauges cost no pass over it.
        self._kept_n = 0
        self._kept_s = 0.0
        self._skip_s: dict[str, float] = {}  # seconds of skipped updates, by cause
        self.executed = 0  # step executions, the discarded ones and unreported ones included
        self.unreported = 0  # executed steps known only from a later record
        self.late = 0  # records that came after newer ones (counted as unreported already)
        self.first_start: float | None = None
        self.last_end: float | None = None
        self._recent: deque[float] = deque(maxlen=RECENT_KEPT)
        self._seen: deque[tuple[int, float]] = deque(maxlen=SEEN_KEPT)
        self._causes: list[tuple[float, str]] = []  # rewinds expected, by time
        # (time, steps): the lead had executed that many steps of its timeline at that time,
        # by its own word (a ping), though their records may never come (`expect_reach`).
        self._reaches: list[tuple[float, int]] = []
        self._disruptions: list[tuple[float, str]] = []  # rank losses and the like, by time
        self._returns: list[float] = []  # when each restarted supervisor came back
        # Rewinds expected of full restarts (`restarting`): the first record after one is the
        # restarted lead's, so one not rewound by it was not rewound at all.
        self._restarts: list[tuple[float, str]] = []
        # (what, cause) -> [steps, seconds]
        self._lost: dict[tuple[str, str | None], list[float]] = {}
        self.outages: list[dict[str, Any]] = []  # supervisor outages (training went on)

    # ------------------------------------------------------------------ input
    def expect_rewind(self, at: float, cause: str) -> None:
        """A rollback was decided, or a full-group restart begun, at `at`: the next rewind is its."""
        bisect.insort(self._causes, (at, cause))

    def restarting(self, at: float, cause: str) -> None:
        """Every rank is restarted at `at` because of `cause`: the rewind to the checkpoint is
        its, and so is the stall (even when the checkpoint is the lead's last step and
        nothing is rewound)."""
        self.expect_rewind(at, cause)
        self.disrupted(at, cause)
        self._restarts.append((at, cause))

    def expect_reach(self, at: float, steps: int) -> None:
        """The lead said at `at` that it had executed `steps` steps of its timeline (its ping,
        just before a full-group restart killed it): the steps whose records it never sent
        count as executed, kept until a rewind discards them. Applied before the first
        record of a step that started after `at`, so a record sent before `at` and taken
        after it still counts as reported."""
        if steps > 0:
            bisect.insort(self._reaches, (at, steps))

    def disrupted(self, at: float, cause: str) -> None:
        """Something stopped the group at `at` (a rank found lost, a restart begun): the first
        idle span of the lead that ends after `at` is its, however long before `at` it began
        (a hung rank stops the group before it is found: the detection is the hang's)."""
        bisect.insort(self._disruptions, (at, cause))

    def outage(self, record: dict[str, Any]) -> None:
        """A supervisor restart: `{incarnation, down_since, back_at, down_s}`. The ranks train on
        without a supervisor: only an idle span that holds `back_at` is the outage's, and only
        when no rank loss falls in it (a rank that hung meanwhile stalled the group)."""
        self.outages.append(record)
        back = record.get("back_at")
        if isinstance(back, int | float) and math.isfinite(back):
            bisect.insort(self._returns, float(back))

    def event(self, step: int, kind: str) -> None:
        """An anomaly at `step`: the cause of that step's update being dropped, if it was."""
        if 0 <= step < len(self._skipped) and self._skipped[step] and step not in self._skip_cause:
            self._skip_cause[step] = kind
            self._bump(self._skip_s, UNATTRIBUTED, -self._dur[step])
            self._bump(self._skip_s, kind, self._dur[step])

    def record(self, rank: int, rec: Mapping[str, Any]) -> None:
        """One validated metrics record (`metrics.jsonl`); only the lead's count."""
        if rank != self.lead:
            return
        step, tick = rec.get("step"), rec.get("tick", rec.get("step"))
        if type(step) is not int or type(tick) is not int or step < 0:
            return
        dur = _seconds(rec.get("step_time_s")) + _seconds(rec.get("loader_time_s"))
        end = rec.get("t_end")
        end = float(end) if isinstance(end, int | float) and math.isfinite(end) else None
        if end is not None:
            if (tick, end) in self._seen:
                return  # a record seen already
            self._seen.append((tick, end))
        if end is not None and self.last_end is not None and end < self.last_end - LATE_S:
            self.late += 1
            return
        start = end - dur if end is not None else None
        self._recent.append(dur)  # the step's own time, for the typical step time
        if start is not None and self.last_end is not None and start < self.last_end:
            # It overlaps the record before (a loader wait measured from before that one's
            # end): its time counts from there, so no second is counted twice.
            start = self.last_end
            dur = max(end - start, 0.0) if end is not None else 0.0
        room = start - self.last_end if start is not None and self.last_end is not None else None
        filled = 0.0
        while self._reaches and start is not None and self._reaches[0][0] <= start:
            filled += self._fill(self._reaches.pop(0)[1], room, filled)
        n = len(self._dur)
        cause = None
        if step < n:
            cause = self._take_cause(start)
            self._add("discarded_steps", cause, n - step, sum(self._dur[step:]))
            self._truncate(step)
        elif step > n:
            filled += self._fill(step, room, filled)
        self._drop_restarts(start)
        if start is not None and end is not None:
            if self.first_start is None:
                self.first_start = start
            if self.last_end is not None:
                self._idle(self.last_end, start, filled, cause)
            self.last_end = end if self.last_end is None else max(self.last_end, end)
        skipped = rec.get("optimizer_skipped") is True
        self._dur.append(dur)
        self._skipped.append(1 if skipped else 0)
        if skipped:
            self._bump(self._skip_s, UNATTRIBUTED, dur)
        else:
            self._kept_n += 1
            self._kept_s += dur
        self.executed += 1

    def _fill(self, steps: int, room: float | None = None, used: float = 0.0) -> float:
        """Extend the timeline to `steps` steps with ones executed whose records never came
        (kept, at the typical step time, or less where the gap they ran in, `room` seconds of
        which `used` are filled already, is shorter); their seconds."""
        missing = steps - len(self._dur)
        if missing <= 0:
            return 0.0
        typical = self._typical()
        if room is not None:
            typical = min(typical, max(room - used, 0.0) / missing)
        self._dur.extend([typical] * missing)
        self._skipped.extend(bytes(missing))
        self._kept_n += missing
        self._kept_s += typical * missing
        self.executed += missing
        self.unreported += missing
        return missing * typical

    def _truncate(self, step: int) -> None:
        """Drop the timeline from `step` on, and its share of the running totals."""
        for i in range(step, len(self._dur)):
            if self._skipped[i]:
                self._bump(self._skip_s, self._skip_cause.pop(i, UNATTRIBUTED), -self._dur[i])
            else:
                self._kept_n -= 1
                self._kept_s -= self._dur[i]
        del self._dur[step:]
        del self._skipped[step:]

    @staticmethod
    def _bump(totals: dict[str, float], key: str, seconds: float) -> None:
        totals[key] = totals.get(key, 0.0) + seconds

    # ---------------------------------------------------------------- helpers
    def _take_cause(self, start: float | None) -> str:
        """The earliest expected rewind decided before `start` (FIFO), else `UNATTRIBUTED`."""
        if self._causes and (start is None or self._causes[0][0] <= start):
            return self._causes.pop(0)[1]
        return UNATTRIBUTED

    def _drop_restarts(self, start: float | None) -> None:
        """A record that started after a full restart: that restart's rewind is taken (by this
        record, or by none: it resumed where the lead was)."""
        if start is None:
            return
        for entry in [e for e in self._restarts if e[0] <= start]:
            self._restarts.remove(entry)
            if entry in self._causes:
                self._causes.remove(entry)

    def _idle(self, since: float, until: float, filled: float, cause: str | None) -> None:
        """The lead ran no step from `since` to `until` (but `filled` seconds of steps whose
        records never came): a stall of the disruptions found before `until` (all taken: one
        stall is theirs), of `cause` (the rewind of the record that ends it), of a supervisor
        that came back in it, or overhead (`stall_cause`)."""
        found = [why for at, why in self._disruptions if at <= until]
        del self._disruptions[: len(found)]
        back = bisect.bisect_right(self._returns, until)
        returned = any(since <= at for at in self._returns[:back])
        del self._returns[:back]
        idle = until - since - filled
        if idle <= 0:
            return
        why = stall_cause(found, returned=returned, rewind=cause)
        self._add("stalled" if why is not None else "overhead", why, 0, idle)

    def _add(self, what: str, cause: str | None, steps: int, seconds: float) -> None:
        entry = self._lost.setdefault((what, cause), [0, 0.0])
        entry[0] += steps
        entry[1] += seconds

    def _typical(self) -> float:
        """The median of the lead's recent step times (0 before any)."""
        return statistics.median(self._recent) if self._recent else 0.0

    # ----------------------------------------------------------------- output
    @property
    def steps(self) -> int:
        """The steps of the current timeline (where the lead's next step starts)."""
        return len(self._dur)

    def kept(self, completed: int | None = None) -> tuple[int, float]:
        """(steps kept, seconds of their last executions) of the first `completed` steps."""
        n = len(self._dur)
        steps, seconds = self._kept_n, self._kept_s
        if completed is not None and completed < n:
            for i in range(completed, n):
                if not self._skipped[i]:
                    steps -= 1
                    seconds -= self._dur[i]
        elif completed is not None and completed > n:
            steps += completed - n  # the lead's last records never came
        return steps, max(seconds, 0.0)

    def step_goodput(self) -> float:
        """Steps kept / steps executed, so far."""
        return self._kept_n / self.executed if self.executed else 0.0

    def ettr(self, started: float, now: float) -> float:
        """Seconds of the kept steps / wall seconds since `started`, so far."""
        return max(self._kept_s, 0.0) / (now - started) if now > started else 0.0

    def lost_by_cause(self) -> dict[str, float]:
        """Seconds lost so far to each cause (the anomaly kind behind it)."""
        out = {k: v for k, v in self._skip_s.items() if v > 1e-9}
        for (_, cause), (_, seconds) in self._lost.items():
            if cause is not None:
                out[cause] = out.get(cause, 0.0) + seconds
        return out

    def summary(
        self,
        *,
        started: float,
        ended: float,
        completed: int,
        fallback_executed: int = 0,
        fallback_skipped: int = 0,
    ) -> dict[str, Any]:
        """The goodput fields of summary.json for a run that completed `completed` steps.

        `fallback_executed`, `fallback_skipped`: the lead's own counts, for a run whose
        records never reached the ledger (the counts then are its tick's, the times unknown).
        """
        if not self.executed:
            kept = max(completed - fallback_skipped, 0)
            return {
                "steps_executed": fallback_executed,
                "steps_kept": kept,
                "updates_skipped": completed - kept,
                "goodput": round(kept / fallback_executed, 4) if fallback_executed else 0.0,
                "ettr": None,
                "time_lost": [],
                "time_lost_by_cause": {},
                "supervisor_downtime": self.outages,
            }
        lost = {k: list(v) for k, v in self._lost.items()}

        def add(what: str, cause: str | None, steps: int, seconds: float) -> None:
            entry = lost.setdefault((what, cause), [0, 0.0])
            entry[0] += steps
            entry[1] += seconds

        n = len(self._dur)
        if completed < n:  # the run ended past a rewind it never replayed
            add("discarded_steps", UNATTRIBUTED, n - completed, sum(self._dur[completed:]))
        for step in range(min(completed, n)):
            if self._skipped[step]:
                cause = self._skip_cause.get(step, UNATTRIBUTED)
                add("skipped_updates", cause, 1, self._dur[step])
        steps_kept, time_kept = self.kept(completed)
        executed = self.executed + max(completed - n, 0)
        wall = max(ended - started, 0.0)
        # The run's start and end, less what of them a supervisor outage held (the ranks
        # ended while none was there to take their results, say): that is the outage's.
        if self.first_start is not None:
            self._edge(add, "startup", started, self.first_start)
        if self.last_end is not None:
            self._edge(add, "shutdown", self.last_end, ended)
        accounted = time_kept + sum(s for _, s in lost.values())
        # What no record places: steps of records without an end time, rounding. The time is
        # a partition (see the module docstring), so this is never a restart's; a record
        # counted past the wall (clocks of two hosts) shows as a negative residue, which is
        # taken off the overhead rather than shown as a negative row.
        residue = wall - accounted
        if residue < 0 and ("overhead", None) in lost:
            take = min(-residue, lost[("overhead", None)][1])
            lost[("overhead", None)][1] -= take
            residue += take
        if residue > 0:
            add("other", None, 0, residue)
        kept_rows = sorted(
            ((what, cause, int(steps), round(seconds, 3))
             for (what, cause), (steps, seconds) in lost.items()
             if steps or abs(seconds) >= 0.0005),
            key=lambda r: (r[1] is None, -r[3]),
        )  # fmt: skip
        by_cause: dict[str, float] = {}
        for _, why, _, seconds in kept_rows:
            if why is not None:
                by_cause[why] = round(by_cause.get(why, 0.0) + seconds, 3)
        rows = [
            {"what": what, "cause": cause, "steps": steps, "seconds": seconds}
            for what, cause, steps, seconds in kept_rows
        ]
        return {
            "steps_executed": executed,
            "steps_kept": steps_kept,
            "updates_skipped": sum(
                int(v[0]) for (what, _), v in lost.items() if what == "skipped_updates"
            ),
            "steps_unreported": self.unreported,
            "goodput": round(steps_kept / executed, 4) if executed else 0.0,
            "ettr": round(time_kept / wall, 4) if wall > 0 else None,
            "time_kept_s": round(time_kept, 3),
            "time_lost": rows,
            "time_lost_by_cause": by_cause,
            "supervisor_downtime": self.outages,
        }

    def _edge(self, add: Any, what: str, since: float, until: float) -> None:
        """Book the run's `startup` or `shutdown` span: to the outages in it, then to itself."""
        seconds = max(until - since, 0.0)
        held = min(outage_seconds(self.outages, since, until), seconds)
        if held > 0:
            add(what, SUPERVISOR_RESTART, 0, held)
        add(what, None, 0, seconds - held)

    # ------------------------------------------------------------------ replay
    @classmethod
    def replay(
        cls,
        wal: Iterable[Mapping[str, Any]],
        *,
        metrics: Iterable[Mapping[str, Any]],
        anomalies: Iterable[Mapping[str, Any]],
        lead: int = 0,
    ) -> GoodputLedger:
        """The ledger of a run, rebuilt from the records of its journals (read by the shell:
        `supervisor.journals.goodput_of`).

        Rewind causes come from journal.wal (rollbacks decided, full-group
        restarts), disruptions from the supervisor's own anomalies (a rank lost)
        and its restarts.
        """
        ledger = cls(lead)
        for r in wal:
            at = ts_of(r.get("ts"))
            if at is None:
                continue
            kind = r.get("type")
            decision = r.get("decision")
            if kind == "decided" and isinstance(decision, dict):
                anomaly = decision.get("anomaly") or {}
                why = str(anomaly.get("kind", UNATTRIBUTED))
                if decision.get("action") in REWINDING_ACTIONS:
                    ledger.expect_rewind(at, why)
                elif decision.get("action") in STALLING_ACTIONS:
                    ledger.disrupted(at, why)
            elif kind == "full_restart":
                ledger.restarting(at, str(r.get("cause", UNATTRIBUTED)))
                if type(r.get("lead_executed")) is int:
                    ledger.expect_reach(at, r["lead_executed"])
            elif kind == "supervisor_restored" and isinstance(r.get("outage"), dict):
                ledger.outage(r["outage"])
        events = list(anomalies)
        for ev in events:
            at = when(ev.get("ts"))
            if ev.get("source") == "supervisor" and at is not None and ev.get("kind") in LOSSES:
                ledger.disrupted(at, str(ev.get("kind")))
        for rec in metrics:
            rank = rec.get("rank")
            if type(rank) is int:
                ledger.record(rank, rec)
        for ev in events:
            if type(ev.get("step")) is int:
                ledger.event(int(ev["step"]), str(ev.get("kind")))
        return ledger


def stall_cause(found: list[str], *, returned: bool, rewind: str | None = None) -> str | None:
    """The cause of an idle span of the lead: the first rank loss or restart found before it
    ended (`found`, in time order), else the rewind of the record that ends it (`rewind`: a
    rollback's restore), else a supervisor restart when a supervisor came back in it
    (`returned`), else none (overhead).

    A loss outranks the rest: a rollback decided before a rank was lost and applied after
    its replacement joined makes the first step after the restart a rewound one, but the
    restart is what the group waited for (the rollback still owns the steps it discarded);
    and a rank that hung while no supervisor watched stalled the group, its detection only
    waiting for the supervisor."""
    losses = [why for why in found if why != SUPERVISOR_RESTART]
    if losses:
        return losses[0]
    if rewind is not None:
        return rewind
    if returned or found:
        return SUPERVISOR_RESTART
    return None


def outage_seconds(outages: Iterable[Mapping[str, Any]], since: float, until: float) -> float:
    """Seconds of `since`..`until` that supervisor outages (`down_since`..`back_at`) cover."""
    spans = sorted(
        (float(o["down_since"]), float(o["back_at"]))
        for o in outages
        if all(isinstance(o.get(k), int | float) for k in ("down_since", "back_at"))
    )
    covered, reach = 0.0, since
    for down, back in spans:
        lo, hi = max(down, reach), min(back, until)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered


def _seconds(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return max(float(value), 0.0)
    return 0.0


def when(value: Any) -> float | None:
    """A record's `ts` in seconds since the epoch: a number as it is, or ISO 8601 as the
    journals write it (anomalies.jsonl stamps each line with its own)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return ts_of(value)


def ts_of(value: Any) -> float | None:
    """A journal line's `ts` (ISO 8601, as structlog writes it) in seconds since the epoch."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
