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
from dataclasses import dataclass, field
from typing import Any

# Out-of-order batches remembered per slot before a missing one is given up on.
MAX_GAP = 1024


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
    last_seq: int = 0  # every batch up to this one has been seen
    pid: int | None = None
    # Batches seen past `last_seq`: after a supervisor restart Ray retries the calls
    # that were in flight, not necessarily in order, so a gap may fill later.
    seen: set[int] = field(default_factory=set)

    def take(self, seq: int) -> bool:
        """Mark batch `seq` seen; False if it was already."""
        if seq <= self.last_seq or seq in self.seen:
            return False
        self.seen.add(seq)
        if len(self.seen) > MAX_GAP:  # a batch that never comes: give up waiting for it
            self.last_seq = min(self.seen) - 1
        while self.last_seq + 1 in self.seen:
            self.last_seq += 1
            self.seen.discard(self.last_seq)
        return True

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "incarnation": self.incarnation,
            "state": self.state.value,
            "last_seq": self.last_seq,
            "seen": sorted(self.seen),
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
                {int(q) for q in r.get("seen", [])},
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
        if isinstance(seq, int) and not slot.take(seq):
            self.refused_duplicate += 1
            return False
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
        slot.seen.clear()
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
