"""The typed sections of the run's record (`record.RunRecord`), each with its JSON form.

A section is a small frozen value: the run's core holds one of each and
replaces it whole when it changes (`run_core.RunCore.step`); the shell
reads it and sends what changed as an input. Each section's `to_json`
gives exactly what the state record in `journal.wal` has held since
schema 8, and `from_json` reads it back (a record migrated from an older
schema included: a key that schema lacked reads as its default).

- `SlotSection`: one rank slot (incarnation, state, batch numbers still
  awaited, pid, node); its `last_seq` is kept apart (`RunRecord.last_seq`).
- `GroupSection`: the worker group's generation and actor names, and its
  spares (names, placement), so a restarted supervisor finds them by name.
- `RestartSection`: the restart in progress (`restart.RestartState`, with
  its deadline), the wall times of its stages, one record per restart.
- `LossesSection`: the losses reported and what became of them
  (`lost_ranks.LostRanks`), the other half of the JSON `recovery` section.
- `HangSection`: the hang watch's entry per rank (its p99 step time and
  first steps seen), so a restarted supervisor watches each rank with its
  own timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from remedy.control.restart import RestartState


@dataclass(frozen=True, slots=True)
class SlotSection:
    """One rank's slot as the record keeps it (`slots.Slot.state_dict`)."""

    rank: int
    incarnation: int = 1
    state: str = "starting"
    gaps: tuple[int, ...] = ()
    pid: int | None = None
    node: str | None = None
    # Its JSON form as `RankSlots` built it, given again while the slot is unchanged: at
    # thousands of ranks `record.StateLog` then skips nearly every slot by identity.
    given: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        if self.given is not None:
            return self.given
        return {
            "rank": self.rank,
            "incarnation": self.incarnation,
            "state": self.state,
            "gaps": list(self.gaps),
            "pid": self.pid,
            "node": self.node,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SlotSection:
        return cls(
            rank=int(data["rank"]),
            incarnation=int(data.get("incarnation", 1)),
            state=str(data.get("state", "starting")),
            gaps=tuple(sorted(int(q) for q in data.get("gaps", []))),
            pid=data.get("pid"),
            node=data.get("node"),
        )


@dataclass(frozen=True, slots=True)
class GroupSection:
    """The worker group: its generation, each rank's actor name, and its spares."""

    generation: int = 0
    names: Mapping[int, str] = field(default_factory=dict)  # rank -> its actor's name
    spares: tuple[str, ...] = ()  # the warm spares' names, oldest first
    next_spare: int = 0  # the number of the last spare named
    spare_nodes: Mapping[str, str | None] = field(default_factory=dict)  # spare -> its node
    local_spares: frozenset[str] = frozenset()  # spares kept on a node for its ranks
    dead_nodes: frozenset[str] = frozenset()  # nodes Ray called dead

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "names": {str(r): n for r, n in self.names.items()},
            "spares": list(self.spares),
            "next_spare": self.next_spare,
            "spare_nodes": dict(self.spare_nodes),
            "local_spares": sorted(self.local_spares),
            "dead_nodes": sorted(self.dead_nodes),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupSection:
        return cls(
            generation=int(data.get("generation", 0)),
            names={int(r): str(n) for r, n in data.get("names", {}).items()},
            spares=tuple(str(n) for n in data.get("spares", [])),
            next_spare=int(data.get("next_spare", 0)),
            spare_nodes={
                str(n): (None if at is None else str(at))
                for n, at in data.get("spare_nodes", {}).items()
            },
            local_spares=frozenset(str(n) for n in data.get("local_spares", [])),
            dead_nodes=frozenset(str(n) for n in data.get("dead_nodes", [])),
        )


@dataclass(frozen=True, slots=True)
class RestartSection:
    """The restart in progress and the restarts done: the restart half of `recovery`."""

    marks: Mapping[str, float] = field(default_factory=dict)  # stage -> its wall time
    machine: RestartState | None = None  # the restart in progress, with its deadline
    records: tuple[Mapping[str, Any], ...] = ()  # one per restart (summary, benchmarks)

    def to_json(self) -> dict[str, Any]:
        return {
            "marks": dict(self.marks),
            "restart": self.machine.to_dict() if self.machine is not None else None,
            "records": list(self.records),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RestartSection:
        machine = data.get("restart")
        return cls(
            marks={str(k): float(v) for k, v in data.get("marks", {}).items()},
            machine=RestartState.from_dict(machine) if machine else None,
            records=tuple(data.get("records", [])),
        )


# The keys of the JSON `recovery` section that are the restart's (the rest are the losses').
RESTART_KEYS = frozenset({"marks", "restart", "records"})


@dataclass(frozen=True, slots=True)
class LossesSection:
    """The losses reported and what became of them: the losses half of `recovery`."""

    detected_at: Mapping[int, float] = field(default_factory=dict)  # rank -> found lost at
    joining: Mapping[int, str] = field(default_factory=dict)  # rank -> why it joins a restart
    # (rank, incarnation) of each process reported lost, still current.
    reported: tuple[tuple[int, int], ...] = ()
    lost_on: Mapping[int, tuple[str, float]] = field(default_factory=dict)  # rank -> node, at
    held: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # node -> its ranks

    def empty(self) -> bool:
        """Nothing found lost and nothing reported: no `recovery` section of its own."""
        return not (self.detected_at or self.reported)

    def to_json(self) -> dict[str, Any]:
        return {
            "detected_at": {str(r): t for r, t in self.detected_at.items()},
            "joining": {str(r): why for r, why in self.joining.items()},
            "losses": {
                "reported": [[r, i] for r, i in self.reported],
                "lost_on": {str(r): [n, at] for r, (n, at) in self.lost_on.items()},
                "held": {n: list(rs) for n, rs in self.held.items()},
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LossesSection:
        losses = data.get("losses") or {}
        return cls(
            detected_at={int(r): float(t) for r, t in data.get("detected_at", {}).items()},
            joining={int(r): str(why) for r, why in data.get("joining", {}).items()},
            reported=tuple((int(r), int(i)) for r, i in losses.get("reported", [])),
            lost_on={
                int(r): (str(n), float(at)) for r, (n, at) in losses.get("lost_on", {}).items()
            },
            held={str(n): tuple(int(r) for r in rs) for n, rs in losses.get("held", {}).items()},
        )


class HangEntry(NamedTuple):
    """The hang watch's entry of one rank: its p99 step time (s) and first steps seen."""

    p99: float
    seen: int


@dataclass(frozen=True, slots=True)
class HangSection:
    """rank -> its `HangEntry`, for each rank that reported a step."""

    entries: Mapping[int, HangEntry] = field(default_factory=dict)

    def to_json(self) -> dict[str, list[float]]:
        return {str(r): [e.p99, e.seen] for r, e in self.entries.items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HangSection:
        """The entries of `data`; one that is not an entry is left out (its rank then gets
        the start-up allowance, as a rank the watch never saw step)."""
        out: dict[int, HangEntry] = {}
        for r, entry in data.items():
            if not (isinstance(entry, list | tuple) and len(entry) == 2):
                continue
            if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in entry):
                continue
            try:
                out[int(r)] = HangEntry(entry[0], entry[1])
            except ValueError:
                continue
        return cls(out)
