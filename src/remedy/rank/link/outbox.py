"""The outbox of one rank: events, metrics and outcomes on their way out, and the heartbeat.

One implementation for the `Guard` and the framework callbacks. A report
goes out at once when there is news (an event, an outcome; the caller says
`force`), else at most every `heartbeat_s`, so a healthy rank costs the
supervisor one small batch per heartbeat. Metrics records are built when a
report leaves (`build`), a batch at a time, not at every step. Sending
never waits for the answer unless asked (`wait`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from remedy.rank.link.context import Reporter
from remedy.rank.link.inbox import CommandInbox


class Outbox:
    """What this rank reports next, and when it last reported."""

    def __init__(
        self,
        reporter: Reporter,
        inbox: CommandInbox,
        *,
        rank: int,
        heartbeat_s: float,
        build: Callable[[Any], dict[str, Any]] | None = None,
    ) -> None:
        self.reporter = reporter
        self.inbox = inbox  # its outcomes go out with the next report
        self.rank = rank
        self.heartbeat_s = heartbeat_s
        # A reporter that watches the supervisor's answers derives its bound from the heartbeat.
        set_heartbeat = getattr(reporter, "set_heartbeat", None)
        if set_heartbeat is not None:
            set_heartbeat(heartbeat_s)
        self._build = build
        self._events: list[dict[str, Any]] = []
        self._metrics: list[Any] = []
        self._last_send = -math.inf  # never: the first report goes at once
        self._regrouped = False  # the next report is the first of a new generation

    def event(self, record: dict[str, Any]) -> None:
        """Queue one anomaly (its wire form, `AnomalyEvent.to_dict()`)."""
        self._events.append(record)

    def metrics(self, item: Any) -> None:
        """Queue one step's metrics (built into a record by `build` when the report leaves)."""
        self._metrics.append(item)

    def soon(self) -> None:
        """Let the next report go out at once, whatever the heartbeat."""
        self._last_send = -math.inf

    def regrouped(self) -> None:
        """The rank is in a new generation of its group: its next report goes out at once and
        says so (`regrouped`), for a restart waits on it; a node agent then sends its digest
        early instead of at the end of its period (`supervisor.agent`)."""
        self.soon()
        self._regrouped = True

    def send(
        self, *, step: int, tick: int, force: bool = False, wait: bool = False, **fields: Any
    ) -> bool:
        """Report now if there is news or the heartbeat is due; True if a report went out."""
        now = time.monotonic()
        if (
            not (force or wait or self.inbox.has_unsent)
            and now - self._last_send < self.heartbeat_s
        ):
            return False
        build = self._build
        batch = {
            "rank": self.rank,
            "step": step,
            "tick": tick,
            "ts": time.time(),
            "events": self._events,
            "metrics": [build(m) for m in self._metrics] if build else self._metrics,
            "outcomes": self.inbox.drain_outcomes(),
            **fields,
        }
        if self._regrouped:
            batch["regrouped"], self._regrouped = True, False
        self._events, self._metrics = [], []
        self._last_send = now
        self.reporter.send(batch, wait=wait)
        return True
