"""Rank slots: one per rank of the job, each with an incarnation number.

A slot outlives the processes that fill it. Replacing a rank bumps its
incarnation; reports carry (rank, incarnation, seq), and a report from an
incarnation that is no longer the slot's (a message in flight from a
process that was killed) is refused and counted, so a dead process can
neither move the hang watch nor answer commands. Ray runs an async actor's
calls in no guaranteed order, so a batch may arrive after a later one of its
rank: a number is a duplicate when it was seen, not when it is below the
highest (numbers within `SEQ_WINDOW` of the highest are remembered; older
ones are refused). A sequence number further
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
from dataclasses import dataclass, field
from typing import Any

# How far a batch sequence number may run ahead of the slot's last accepted one:
# at once, and per second since (a Guard sends a few batches a step at most).
MAX_SEQ_AHEAD = 10_000
SEQ_AHEAD_PER_S = 10_000
# Batch numbers remembered below the highest seen: a rank has at most
# `reporter.MAX_IN_FLIGHT` (64) batches in flight, so none arrives later than that.
SEQ_WINDOW = 1024


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
    seen: set[int] = field(default_factory=set)  # accepted numbers above last_seq - SEQ_WINDOW
    # Numbers up to here count as seen: a slot rebuilt from its record (which keeps
    # `last_seq`, not `seen`) sets it to `last_seq`, so nothing is taken twice.
    floor: int = 0

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
        if type(seq) is int and not self._take_seq(slot, seq):
            return False
        if slot.state is SlotState.STARTING:
            slot.state = SlotState.RUNNING
        return True

    def _take_seq(self, slot: Slot, seq: int) -> bool:
        """Accept `seq` for `slot` unless seen, too old to tell, or absurdly far ahead."""
        if seq <= max(slot.last_seq - SEQ_WINDOW, slot.floor, 0) or seq in slot.seen:
            self.refused_duplicate += 1
            self.rejected["batch_duplicate_seq"] += 1
            return False
        if seq > slot.last_seq:
            now = self._clock()
            slack = MAX_SEQ_AHEAD + int(max(now - slot.last_at, 0.0) * SEQ_AHEAD_PER_S)
            if seq > slot.last_seq + slack:
                self.rejected["batch_seq_too_far_ahead"] += 1
                return False
            slot.last_seq, slot.last_at = seq, now
        slot.seen.add(seq)
        if len(slot.seen) > 2 * SEQ_WINDOW:
            floor = slot.last_seq - SEQ_WINDOW
            slot.seen = {s for s in slot.seen if s > floor}
        return True

    def lose(self, rank: int) -> None:
        """The rank's process is hung or dead: its reports no longer count."""
        self.slots[rank].state = SlotState.LOST

    def replace(self, rank: int) -> int:
        """Open the slot for a new process; return its incarnation."""
        slot = self.slots[rank]
        slot.incarnation += 1
        slot.state = SlotState.STARTING
        slot.last_seq = slot.floor = 0
        slot.seen = set()
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
