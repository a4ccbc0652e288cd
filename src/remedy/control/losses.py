"""The supervisor's record of lost ranks: which process was reported lost, and where it ran.

A rank's process (rank, incarnation) goes to the policy as lost once; a
node whose ranks were all found lost in the last `window_s` is what a node's
death looks like before Ray's verdict on it, and once the verdict comes the
node's loss names those ranks too, replaced already or not. All of it is in
the supervisor's state record (`record`, `from_record`), so a supervisor
that Ray restarts neither reports a process lost twice nor forgets which
node its lost ranks ran on. Pure: no Ray, no clock of its own (wall times
are given).

Where a loss goes (`route`) is decided here too: evidence about a process
already replaced is dropped, a process reported once is not reported again,
a rank that a restart is starting failed that start, a rank lost while a
restart is decided or under way joins it, and any other goes to the policy.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class Route(enum.StrEnum):
    """Where the loss of a rank's process goes (`Losses.route`)."""

    STALE = "stale"  # the evidence is about a process already replaced: dropped
    REPORTED = "reported"  # this process was reported lost already
    START_FAILED = "start_failed"  # a restart is starting this rank: that start failed
    JOIN = "join"  # a restart is decided or under way: it replaces this rank too
    POLICY = "policy"  # to the policy, as an anomaly


@dataclass
class Losses:
    """Processes reported lost, and the nodes the lost ones ran on (see the module docstring)."""

    window_s: float
    reported: set[tuple[int, int]] = field(default_factory=set)  # (rank, incarnation)
    # rank -> (the node its lost process ran on, wall time it was found lost)
    lost_on: dict[int, tuple[str, float]] = field(default_factory=dict)
    # node -> the ranks it held when the first of them was found lost
    held: dict[str, set[int]] = field(default_factory=dict)

    def route(
        self,
        rank: int,
        current: int,
        evidence: int | None,
        *,
        starting: bool,
        under_way: bool,
    ) -> Route:
        """Where the loss of `rank` goes: `current` is its process now, `evidence` the one the
        evidence is about (None: the current one); `starting`: a restart is starting this
        rank; `under_way`: a restart is decided or running. A process routed anywhere but
        `STALE` or `REPORTED` is marked reported (`first`)."""
        if evidence is not None and evidence != current:
            return Route.STALE
        if not self.first(rank, current):
            return Route.REPORTED
        if starting:
            return Route.START_FAILED
        return Route.JOIN if under_way else Route.POLICY

    def first(self, rank: int, incarnation: int) -> bool:
        """Mark (rank, incarnation) reported; False if it was already."""
        key = (rank, incarnation)
        if key in self.reported:
            return False
        self.reported.add(key)
        return True

    def mark(self, rank: int, incarnation: int) -> None:
        """(rank, incarnation) is accounted for (a restart takes it in): never reported lost."""
        self.reported.add((rank, incarnation))

    def back(self, rank: int, incarnation: int) -> None:
        """The process came back on its own: a later loss of it is reported again."""
        self.reported.discard((rank, incarnation))

    def on_node(self, rank: int, node: str, node_ranks: Iterable[int], at: float) -> None:
        """`rank`, found lost at `at`, ran on `node`, which held `node_ranks` then."""
        self.lost_on[rank] = (node, at)
        self.held.setdefault(node, set()).update(node_ranks, (rank,))

    def earlier(self, node: str, now: float) -> set[int]:
        """The ranks found lost on `node` in the last `window_s` (replaced already, perhaps)."""
        return {r for r, (n, at) in self.lost_on.items() if n == node and now - at <= self.window_s}

    def silent_nodes(self, now: float) -> set[str]:
        """Nodes every rank of which was found lost in the last `window_s`."""
        lost: dict[str, set[int]] = {}
        for r, (node, at) in self.lost_on.items():
            if now - at <= self.window_s:
                lost.setdefault(node, set()).add(r)
        return {node for node, ranks in lost.items() if self.held.get(node, set()) <= ranks}

    # ------------------------------------------------------------- record
    def record(self, incarnations: Mapping[int, int], now: float) -> dict[str, Any]:
        """What the state record keeps: the reported processes still current (a replaced one
        can never be reported again) and the losses of the last `window_s` with their nodes."""
        recent = {r: (n, at) for r, (n, at) in self.lost_on.items() if now - at <= self.window_s}
        nodes = {n for n, _ in recent.values()}
        return {
            "reported": sorted([r, i] for r, i in self.reported if incarnations.get(r) == i),
            "lost_on": {str(r): [n, at] for r, (n, at) in sorted(recent.items())},
            "held": {n: sorted(rs) for n, rs in sorted(self.held.items()) if n in nodes},
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None, window_s: float) -> Losses:
        """The record's losses back (an empty record of an older remedy: nothing reported)."""
        out = cls(window_s)
        if not record:
            return out
        out.reported = {(int(r), int(i)) for r, i in record.get("reported", [])}
        out.lost_on = {
            int(r): (str(n), float(at)) for r, (n, at) in record.get("lost_on", {}).items()
        }
        out.held = {str(n): {int(r) for r in rs} for n, rs in record.get("held", {}).items()}
        return out
