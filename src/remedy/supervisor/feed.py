"""What a watcher of a run sees, kept by the supervisor: one ordered feed of events.

The supervisor actor notes each report batch, each decision it journals and
the lines the ranks print; a display (`remedy run` now, `remedy attach`
later) polls `since(cursor)` and gets the new events plus a fresh progress
snapshot. Events are plain dicts with an `event` key:

- `output`: `rank`, `stream` (stdout or stderr), `line` — the user's own output
- `anomaly`: one anomaly event as the rank reported it
- `decision`: one journaled decision record
- `progress`: step, total, loss, LR, loss scale, samples per second, ETA, per-rank state
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# Events kept for late pollers; a display that falls further behind is told how many it missed.
KEEP = 5000
# A rank that has not reported for this long is shown as quiet, not training.
QUIET_AFTER_S = 10.0
RATE_WINDOW_S = 20.0


def _count(value: Any) -> bool:
    """A step count a float holds exactly (not a bool)."""
    return type(value) is int and 0 <= value < 2**53


class Feed:
    """The supervisor's event feed for displays."""

    def __init__(self, world_size: int, *, clock: Callable[[], float] = time.time) -> None:
        self.world_size = world_size
        self._clock = clock
        self._events: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self._next = 0  # sequence number of the next event
        self._decisions_seen = 0
        self.total: int | None = None
        self.batch_size: int | None = None
        self.last_metrics: dict[int, dict[str, Any]] = {}
        self.last_seen: dict[int, float] = {}
        self.rank_state: dict[int, str] = {}
        self._ticks: deque[tuple[float, int]] = deque()  # (time, rank 0's tick)

    def _add(self, kind: str, event: dict[str, Any]) -> None:
        # Output lines carry the time the rank printed them and anomalies the time
        # they were seen; the rest is stamped on arrival (see `since`).
        ts = event.get("ts")
        if not isinstance(ts, float) or not math.isfinite(ts):
            ts = self._clock()
        record = {"seq": self._next, "event": kind, **event}
        # Set again after the fields: an event's own keys never replace its kind or number.
        record.update(seq=self._next, event=kind, ts=ts)
        self._events.append(record)
        self._next += 1

    # ------------------------------------------------------------ inputs
    def observe(self, batch: Any) -> None:
        """Note the valid parts of one report batch (`Report.as_batch()`; never raises).

        The supervisor hands over what the controller accepted: raw input could
        show a display another rank's numbers, or a step total no float can hold.
        """
        rank = batch.get("rank") if isinstance(batch, dict) else None
        if type(rank) is not int or not 0 <= rank < self.world_size:
            return
        now = self._clock()
        self.last_seen[rank] = now
        self.rank_state.setdefault(rank, "training")
        if _count(batch.get("max_steps")):
            self.total = batch["max_steps"]
        if _count(batch.get("batch_size")):
            self.batch_size = batch["batch_size"]
        metrics = batch.get("metrics")
        if isinstance(metrics, list) and metrics and isinstance(metrics[-1], dict):
            self.last_metrics[rank] = metrics[-1]
        if rank == 0 and _count(batch.get("tick")):
            self._ticks.append((now, batch["tick"]))
            while self._ticks and now - self._ticks[0][0] > RATE_WINDOW_S:
                self._ticks.popleft()
        for ev in batch.get("events") or []:
            if isinstance(ev, dict):
                self._add("anomaly", ev)

    def output(self, lines: Any) -> None:
        """Lines a rank printed (see `remedy.rank.link.output`)."""
        for item in lines if isinstance(lines, list) else []:
            if isinstance(item, dict):
                self._add("output", item)

    def decisions(self, journaled: list[dict[str, Any]]) -> None:
        """Take the decisions journaled since the last call (the controller's list only grows)."""
        for record in journaled[self._decisions_seen :]:
            self._add("decision", record)
        self._decisions_seen = len(journaled)

    def set_rank_state(self, rank: int, state: str) -> None:
        """What the display shows for a rank: its end status, or a worker-group state (suspect, replacing, ...)."""
        self.rank_state[rank] = state

    # ----------------------------------------------------------- outputs
    def since(self, cursor: int, status: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
        """Events after `cursor` and the progress snapshot; returns (events, next cursor)."""
        first = self._next - len(self._events)
        # In the order things happened: a rank's lines reach the feed up to a flush
        # interval after the decisions their step led to.
        events = sorted((e for e in self._events if e["seq"] >= cursor), key=lambda e: e["ts"])
        if cursor < first:
            events.insert(0, {"event": "missed", "count": first - cursor})
        events.append(self.progress(status))
        return events, self._next

    def steps_per_s(self) -> float | None:
        if len(self._ticks) < 2:
            return None
        (t0, k0), (t1, k1) = self._ticks[0], self._ticks[-1]
        return (k1 - k0) / (t1 - t0) if t1 > t0 and k1 >= k0 else None

    def progress(self, status: dict[str, Any]) -> dict[str, Any]:
        now = self._clock()
        lead = self.last_metrics.get(0) or next(iter(self.last_metrics.values()), {})
        step = max(status.get("step", {}).values(), default=0)
        rate = self.steps_per_s()
        samples = rate * self.batch_size * self.world_size if rate and self.batch_size else None
        eta = (self.total - step) / rate if rate and self.total is not None else None
        ranks = {}
        for rank in range(self.world_size):
            state = self.rank_state.get(rank, "starting")
            seen = self.last_seen.get(rank)
            if state == "training" and seen is not None and now - seen > QUIET_AFTER_S:
                state = f"quiet {now - seen:.0f}s"
            ranks[str(rank)] = state
        return {
            "event": "progress",
            "state": status.get("state"),
            "step": step,
            "total": self.total,
            "loss": lead.get("loss"),
            "lr": lead.get("lr"),
            "loss_scale": lead.get("loss_scale"),
            "grad_norm": lead.get("grad_norm"),
            "steps_per_s": round(rate, 3) if rate else None,
            "samples_per_s": round(samples, 1) if samples else None,
            "eta_s": round(max(eta, 0.0), 1) if eta is not None else None,
            "ranks": ranks,
            "anomalies": status.get("anomalies", {}),
            "actions": status.get("actions", {}),
            "wall_s": status.get("wall_s"),
        }
