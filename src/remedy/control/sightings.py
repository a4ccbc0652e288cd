"""Hang and death detection under node agents: the agents ping, the supervisor names.

Without agents the supervisor's hang watch (`supervisor.core.hang_watch`) is fed
by every rank's reports, and when it suspects a rank the supervisor pings
every rank. Under node agents each agent runs the same watch over its own
ranks, fed by the reports it takes (it sees each at once; the supervisor
sees them up to one digest later), and when it suspects one of them it pings
its own ranks and sends what it saw upward at once: one *sighting* per rank,
with the incarnation pinged, whether the rank is stalled in the agent's
watch, its progress age and timeout, and its ping's answer (its status, no
answer, or its actor gone).

One node's sightings are not enough to name the hung rank. A rank stopped
inside a collective stops every rank of the group, on every node: the agent
of the stopped rank's node sees one stalled rank that does not answer, and
`HangWatch.judge` counts a round in which nobody answered as the node or
Ray being stalled, not one rank; another node's agent sees ranks that
answer, and nothing to name. So the supervisor names: it holds every
agent's latest sightings (`Sightings`), and once one says a rank is stalled
it judges one round over every rank of the group with the same
`HangWatch.judge`, asking only the agents whose ranks it has no fresh
sighting of to ping theirs (one call per node, not per rank). In steady
state the supervisor pings no rank and calls no agent.

This module holds the pure parts: the wire form of a sighting
(`sighting_items` at the agent, `Sighting.from_wire` at the supervisor) and
the supervisor's table of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from remedy.control.hang_watch import DEAD, NO_ANSWER, HangWatch
from remedy.protocol import phases

# A sighting older than this is not part of a judging round: the agent pings again
# every `AGENT_PING_EVERY_S` while a rank stays stalled, so a live stall's are newer.
FRESH_S = 1.0
# No second ping round of an agent's ranks sooner than this (as the supervisor's).
AGENT_PING_EVERY_S = 0.25
# A rank that answers a ping from its group's recovery (phase `recovering`: it waits for
# the supervisor's order to regroup, or adopts state; `joining`: it forms the ordered
# generation) is left unpinged this long: the restart that re-forms its group is the
# supervisor's, with its own bounds, and a long state adoption would otherwise bring one
# round of sightings every AGENT_PING_EVERY_S from every agent.
RECOVERING_QUIET_S = 5.0
# Keys of a rank's ping answer a sighting carries (what `judge` and the display read).
PING_KEYS = ("phase", "tick", "step", "generation", "loop_phase")
# How a sighting writes a ping that was not answered, or whose actor is gone.
WIRE_NO_ANSWER = "no_answer"


@dataclass(frozen=True, slots=True)
class Sighting:
    """One agent's view of one rank at one ping round."""

    rank: int
    incarnation: int
    node: str  # the agent's node (its short id)
    stalled: bool  # suspect in the agent's watch after the ping
    ping: dict[str, Any] | str | None  # the rank's status, `DEAD` or `NO_ANSWER`
    age_s: float  # how long its progress has not moved, at the agent
    timeout_s: float  # its timeout in the agent's watch
    suspected_at: float  # wall time the agent first suspected this stall (0: not suspect)
    pinged_at: float  # wall time the agent's ping round began
    received: float = 0.0  # the supervisor's monotonic time of arrival

    @classmethod
    def from_wire(cls, node: str, raw: Any, received: float) -> Sighting | None:
        """A sighting as plain bounded data, else None (refused)."""
        if not isinstance(raw, Mapping):
            return None
        rank, incarnation = raw.get("rank"), raw.get("incarnation")
        if type(rank) is not int or type(incarnation) is not int or rank < 0 or incarnation < 0:
            return None
        numbers: list[Any] = [
            raw.get(k) for k in ("age_s", "timeout_s", "suspected_at", "pinged_at")
        ]
        if not all(_a_number(v) for v in numbers):
            return None
        age, timeout, suspected, pinged = (float(v) for v in numbers)
        wire = raw.get("ping")
        ping: dict[str, Any] | str | None
        if wire == DEAD:
            ping = DEAD
        elif wire == WIRE_NO_ANSWER:
            ping = NO_ANSWER
        elif isinstance(wire, Mapping):
            ping = {k: wire[k] for k in PING_KEYS if k in wire}
            if not all(_a_number(ping.get(k, 0)) for k in ("tick", "step", "generation")):
                return None
            if not isinstance(ping.get("phase", ""), str):
                return None
            if "loop_phase" in ping:  # kept only as the plain entry it must be
                entry = phases.loop_phase(ping)
                del ping["loop_phase"]
                if entry is not None:
                    name, for_s, bound_s = entry
                    ping["loop_phase"] = {"name": name[:64], "for_s": for_s, "bound_s": bound_s}
        else:
            return None
        return cls(
            rank, incarnation, node, raw.get("stalled") is True, ping, age, timeout, suspected,
            pinged, received,
        )  # fmt: skip


def _a_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def sighting_items(
    watch: HangWatch,
    pings: Mapping[int, Any],
    incarnations: Mapping[int, int],
    *,
    now: float,
    suspected_at: float,
    pinged_at: float,
) -> list[dict[str, Any]]:
    """The agent's sightings of one ping round over its ranks, as sent upward.

    `pings[rank]`: the rank's status dict, `NO_ANSWER` or `DEAD`, as
    `pings.ping_actors` answers; `now` on the watch's clock, after the
    answers came (and moved the watch); `suspected_at` and `pinged_at` are
    wall times.
    """
    stalled = set(watch.suspects(now))
    items: list[dict[str, Any]] = []
    for rank in sorted(pings):
        p = pings[rank]
        if p == DEAD:
            wire: dict[str, Any] | str = DEAD
        elif isinstance(p, Mapping):
            wire = {k: p[k] for k in PING_KEYS if k in p}
        else:
            wire = WIRE_NO_ANSWER
        known = watch.knows(rank)
        items.append({
            "rank": rank,
            "incarnation": incarnations.get(rank, 0),
            "stalled": rank in stalled,
            "ping": wire,
            "age_s": round(watch.age(rank, now), 4) if known else 0.0,
            "timeout_s": round(watch.timeout(rank), 4) if known else 0.0,
            "suspected_at": suspected_at if rank in stalled else 0.0,
            "pinged_at": pinged_at,
        })  # fmt: skip
    return items


class Sightings:
    """The supervisor's table: each rank's latest sighting by any agent."""

    def __init__(self, fresh_s: float = FRESH_S) -> None:
        self.fresh_s = fresh_s
        self._latest: dict[int, Sighting] = {}
        self.calls = 0  # agents' calls (each one ping round of one node)
        self.version = 0  # moves with every sighting taken
        self.received = 0  # sightings taken
        self.refused = 0  # sightings that were not plain bounded data

    def add(self, node: str, items: Any, now: float) -> list[Sighting]:
        """One agent's call: its sightings taken (a rank's newest wins); returns those taken."""
        taken: list[Sighting] = []
        self.calls += 1
        if not isinstance(items, list):
            self.refused += 1
            return taken
        for raw in items:
            s = Sighting.from_wire(node, raw, now)
            if s is None:
                self.refused += 1
                continue
            old = self._latest.get(s.rank)
            if old is not None and old.incarnation > s.incarnation:
                continue  # about a process replaced already
            self._latest[s.rank] = s
            self.version += 1
            taken.append(s)
        self.received += len(taken)
        return taken

    def fresh(self, now: float, incarnations: Mapping[int, int]) -> dict[int, Sighting]:
        """Each rank's sighting that is recent and about its current process."""
        return {
            r: s
            for r, s in self._latest.items()
            if now - s.received <= self.fresh_s and s.incarnation == incarnations.get(r, -1)
        }

    def stalled(self, now: float, incarnations: Mapping[int, int]) -> dict[int, Sighting]:
        """The fresh sightings of ranks an agent holds stalled: what starts a judging round."""
        return {r: s for r, s in self.fresh(now, incarnations).items() if s.stalled}

    def round(
        self, ranks: Iterable[int], now: float, incarnations: Mapping[int, int]
    ) -> tuple[dict[int, Any], list[int]]:
        """(`judge`'s pings over `ranks` from the fresh sightings, the ranks without one)."""
        fresh = self.fresh(now, incarnations)
        pings: dict[int, Any] = {}
        missing: list[int] = []
        for r in sorted(ranks):
            if r in fresh:
                pings[r] = fresh[r].ping
            else:
                missing.append(r)
        return pings, missing

    def clear(self) -> None:
        """Forget every sighting (a restart began: the next stall is judged on new ones)."""
        self._latest.clear()
