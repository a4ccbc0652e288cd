"""Rank slots: one per rank of the job, each with an incarnation number.

A slot outlives the processes that fill it. Replacing a rank bumps its
incarnation; reports carry (rank, incarnation, seq), and a report from an
incarnation that is no longer the slot's (a message in flight from a
process that was killed) is refused and counted, so a dead process can
neither move the hang watch nor answer commands. A sequence number further
ahead of the slot's last than its process could have sent is refused too:
accepted, it would make every real report after it a duplicate. Refusals
are counted by reason in the `rejected` counter given (the Controller's, so
they reach `summary.json`). `records()` are plain dicts a supervisor could
rebuild the slots from.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# How far a batch sequence number may run ahead of the slot's last accepted one:
# at once, and per second since (a Guard sends a few batches a step at most).
MAX_SEQ_AHEAD = 10_000
SEQ_AHEAD_PER_S = 10_000


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
    last_at: float = 0.0  # when `last_seq` was accepted or the slot opened (this process's clock)

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

    def __init__(
        self,
        world_size: int,
        *,
        rejected: Counter[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self.slots = {rank: Slot(rank, last_at=clock()) for rank in range(world_size)}
        self.rejected: Counter[str] = Counter() if rejected is None else rejected
        self.refused_stale = 0  # reports from a replaced incarnation
        self.refused_duplicate = 0  # a batch sequence number seen already

    def accept(self, rank: Any, incarnation: Any, seq: Any) -> bool:
        """True if a report of (rank, incarnation, seq) is current; counts what it refuses.

        Reports without an incarnation (a single-process Guard, an old client)
        are accepted: there is nothing to compare.
        """
        # `type(...) is int`: True would name slot 1, and a batch's header is untrusted.
        slot = self.slots.get(rank) if type(rank) is int else None
        if slot is None or type(incarnation) is not int:
            return True
        if incarnation != slot.incarnation or slot.state is SlotState.LOST:
            self.refused_stale += 1
            self.rejected["batch_stale_incarnation"] += 1
            return False
        if type(seq) is int:
            if seq <= slot.last_seq:
                self.refused_duplicate += 1
                self.rejected["batch_duplicate_seq"] += 1
                return False
            now = self._clock()
            slack = MAX_SEQ_AHEAD + int(max(now - slot.last_at, 0.0) * SEQ_AHEAD_PER_S)
            if seq > slot.last_seq + slack:
                self.rejected["batch_seq_too_far_ahead"] += 1
                return False
            slot.last_seq, slot.last_at = seq, now
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
        slot.last_at = self._clock()
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
