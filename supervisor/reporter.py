"""The rank side of the supervisor link: send reports, collect commands, never block.

Each report is an actor call whose reply carries the commands this rank
still owes. Replies are collected with a zero-timeout `ray.wait` at the
next step boundary, so the training loop never waits on the supervisor.
"""

from __future__ import annotations

from typing import Any

import ray
import structlog

log = structlog.get_logger("remedy.reporter")

# Replies kept in flight before the oldest is waited for; bounds memory if
# the supervisor falls behind.
MAX_IN_FLIGHT = 64


class RayReporter:
    """Sends this rank's batches stamped with (rank, incarnation, seq) and the run's token.

    The supervisor refuses batches of an incarnation it has replaced, so
    messages still in flight from a killed process count for nothing.
    """

    def __init__(
        self, supervisor: Any, *, rank: int = 0, incarnation: int = 1, token: str = ""
    ) -> None:
        self.supervisor = supervisor
        self.token = token  # the run's token: a batch without it is refused
        self.rank = rank
        self.incarnation = incarnation
        self.seq = 0
        self._in_flight: list[ray.ObjectRef] = []
        self._inbox: list[dict[str, Any]] = []
        self.lost_replies = 0

    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        self.seq += 1
        batch["incarnation"] = self.incarnation
        batch["seq"] = self.seq
        batch["token"] = self.token
        ref = self.supervisor.report.remote(batch)
        self._in_flight.append(ref)
        if wait or len(self._in_flight) > MAX_IN_FLIGHT:
            self._collect(timeout=None if wait else 5.0, everything=wait)

    def poll(self) -> list[dict[str, Any]]:
        if self._in_flight:
            self._collect(timeout=0)
        out, self._inbox = self._inbox, []
        return out

    def _collect(self, *, timeout: float | None, everything: bool = False) -> None:
        n = len(self._in_flight) if everything else 1
        ready, self._in_flight = ray.wait(
            self._in_flight,
            num_returns=n if timeout != 0 else len(self._in_flight),
            timeout=timeout,
        )
        for ref in ready:
            try:
                self._inbox.extend(ray.get(ref))
            except ray.exceptions.RayError as exc:
                # A lost reply loses nothing: commands are re-sent until acknowledged.
                self.lost_replies += 1
                log.warning("report_failed", error=str(exc))

    def close(self) -> None:
        self._collect(timeout=10.0, everything=True)
