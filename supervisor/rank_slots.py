"""Rank slots: one per rank of the job, each with an incarnation number.

A slot outlives the processes that fill it. Replacing a rank bumps its
incarnation; reports carry (rank, incarnation, seq), and a report from an
incarnation that is no longer the slot's (a message in flight from a
process that was killed) is refused and counted, so a dead process can
neither move the hang watch nor answer commands. `records()` are plain
dicts a supervisor could rebuild the slots from.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class SlotState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    LOST = "lost"
    ENDED = "ended"


@dataclass(slots=True)
class Slot:
    rank: int
    incarnation: int = 1
    state: SlotState = SlotState.STARTING
    last_seq: int = 0
    pid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "incarnation": self.incarnation,
            "state": self.state.value,
            "last_seq": self.last_seq,
            "pid": self.pid,
        }


class RankSlots:
    """The job's slots; decides which reports count."""

    def __init__(self, world_size: int) -> None:
        self.slots = {rank: Slot(rank) for rank in range(world_size)}
        self.refused_stale = 0  # reports from a replaced incarnation
        self.refused_duplicate = 0  # a batch sequence number seen already

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> RankSlots:
        """The slots `records()` describes (a restarted supervisor's)."""
        slots = cls(0)
        for r in records:
            rank = int(r["rank"])
            slots.slots[rank] = Slot(
                rank,
                int(r["incarnation"]),
                SlotState(r["state"]),
                int(r["last_seq"]),
                r.get("pid"),
            )
        return slots

    def accept(self, rank: Any, incarnation: Any, seq: Any) -> bool:
        """True if a report of (rank, incarnation, seq) is current; counts what it refuses.

        Reports without an incarnation (a single-process Guard, an old client)
        are accepted: there is nothing to compare.
        """
        slot = self.slots.get(rank) if isinstance(rank, int) else None
        if slot is None or not isinstance(incarnation, int):
            return True
        if incarnation != slot.incarnation or slot.state is SlotState.LOST:
            self.refused_stale += 1
            return False
        if isinstance(seq, int):
            if seq <= slot.last_seq:
                self.refused_duplicate += 1
                return False
            slot.last_seq = seq
        if slot.state is SlotState.STARTING:
            slot.state = SlotState.RUNNING
        return True

    def lose(self, rank: int) -> None:
        """The rank's process is hung or dead: its reports no longer count."""
        self.slots[rank].state = SlotState.LOST

    def replace(self, rank: int) -> int:
        """Open the slot for a new process; return its incarnation."""
        slot = self.slots[rank]
        slot.incarnation += 1
        slot.state = SlotState.STARTING
        slot.last_seq = 0
        slot.pid = None
        return slot.incarnation

    def incarnation(self, rank: int) -> int:
        return self.slots[rank].incarnation

    def end(self, rank: int) -> None:
        self.slots[rank].state = SlotState.ENDED

    def live(self) -> list[int]:
        return [r for r, s in self.slots.items() if s.state is not SlotState.LOST]

    def records(self) -> list[dict[str, Any]]:
        return [self.slots[r].to_dict() for r in sorted(self.slots)]
