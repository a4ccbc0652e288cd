"""Rank slots: one per rank of the job, each with an incarnation number.

A slot outlives the processes that fill it. Replacing a rank bumps its
incarnation; reports carry (rank, incarnation, seq), and a report from an
incarnation that is no longer the slot's (a message in flight from a
process that was killed) is refused and counted, so a dead process can
neither move the hang watch nor answer commands. Ray runs an async actor's
calls in no guaranteed order, so a batch may arrive after a later one of its
rank: a number is a duplicate when it was seen, not when it is below the
highest: the numbers skipped below the highest (`Slot.gaps`, within
`SEQ_WINDOW` of it; older ones are refused) are still taken once each, so
the calls Ray retries after a supervisor restart count once, in any order.
A sequence number further
ahead of the slot's last than its process could have sent is refused too:
accepted, it would make every real report after it a duplicate. Refusals
are counted by reason in the `rejected` counter given (the Controller's, so
they reach `summary.json`). `records()` are plain dicts a restarted
supervisor rebuilds the slots from (`from_records`). A state record keeps each
slot's `last_seq` apart from the rest of its record (`state_records`, `seqs`):
it changes at every report, the rest almost never.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from remedy.control.sections import SlotSection

# How far a batch sequence number may run ahead of the slot's last accepted one:
# at once, and per second since (a Guard sends a few batches a step at most).
MAX_SEQ_AHEAD = 10_000
SEQ_AHEAD_PER_S = 10_000
# How far below the highest number seen a skipped one is still awaited: a rank
# has a few dozen batches in flight at most, so none arrives later than that.
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
    last_seq: int = 0  # the highest batch number taken
    pid: int | None = None
    node: str | None = None  # the Ray node id of the process that fills it now
    # When `last_seq` was accepted, as the input that brought it told (None: not known since
    # the slot opened; the next batch then gets no slack for time away).
    last_at: float | None = None
    # Numbers below `last_seq` not taken yet (within SEQ_WINDOW of it): every
    # other number up to `last_seq` was taken. Empty while batches come in order.
    gaps: set[int] = field(default_factory=set)
    # Set by every change of a field of `state_dict` (and by `RankSlots` after it changes
    # `gaps` in place): `RankSlots.state_records` builds this slot's record again only then.
    dirty: bool = field(default=True, compare=False, repr=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name not in _NOT_IN_STATE:
            object.__setattr__(self, "dirty", True)

    def state_dict(self) -> dict[str, Any]:
        """The slot's record in a state record: all but `last_seq` (kept apart, `RankSlots.seqs`)."""
        return {
            "rank": self.rank,
            "incarnation": self.incarnation,
            "state": self.state.value,
            "gaps": sorted(self.gaps),
            "pid": self.pid,
            "node": self.node,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self.state_dict(), "last_seq": self.last_seq}


# Fields a slot's `state_dict` does not hold: changing them leaves its record as it was.
_NOT_IN_STATE = frozenset({"dirty", "last_seq", "last_at"})


class RankSlots:
    """The job's slots; decides which reports count."""

    def __init__(
        self,
        world_size: int,
        *,
        rejected: Counter[str] | None = None,
    ) -> None:
        self.slots = {rank: Slot(rank) for rank in range(world_size)}
        self._incomplete: set[int] = set()  # ranks whose slot has gaps, kept as they change
        self.rejected: Counter[str] = Counter() if rejected is None else rejected
        self.refused_stale = 0  # reports from a replaced incarnation
        self.refused_duplicate = 0  # a batch sequence number seen already
        self._records: dict[int, dict[str, Any]] = {}  # see `state_records`
        self._sections: dict[int, SlotSection] = {}  # see `sections`

    @classmethod
    def from_sections(
        cls,
        sections: Iterable[SlotSection],
        seqs: Mapping[int, int],
        *,
        rejected: Counter[str] | None = None,
    ) -> RankSlots:
        """The slots a record's slots section and its `last_seq` describe (a restarted
        supervisor's). `rejected`: where refusals are counted, as in the constructor."""
        return cls.from_records(
            [s.to_json() for s in sections], {str(r): n for r, n in seqs.items()}, rejected=rejected
        )

    @classmethod
    def from_records(
        cls,
        records: list[dict[str, Any]],
        seqs: dict[str, int] | None = None,
        *,
        rejected: Counter[str] | None = None,
    ) -> RankSlots:
        """The slots `records()` describes (a restarted supervisor's); or `state_records()`
        with `seqs()` (keys as JSON gives them back: strings). `rejected`: where refusals are
        counted, as in the constructor."""
        slots = cls(0, rejected=rejected)
        for r in records:
            rank = int(r["rank"])
            slots.slots[rank] = Slot(
                rank,
                int(r["incarnation"]),
                SlotState(r["state"]),
                int(seqs[str(rank)] if seqs is not None else r["last_seq"]),
                r.get("pid"),
                r.get("node"),
                None,
                {int(q) for q in r.get("gaps", [])},
            )
            slots._note_gaps(slots.slots[rank])
        return slots

    def accept(self, rank: Any, incarnation: Any, seq: Any, now: float | None = None) -> bool:
        """True if a report of (rank, incarnation, seq) is current; counts what it refuses.

        `now`: when it arrived (any clock, the same for every call); a number may run
        further ahead the longer the rank was away. None: the time is not told.

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
        if type(seq) is int and not self._take_seq(slot, seq, now):
            return False
        if slot.state is SlotState.STARTING:
            slot.state = SlotState.RUNNING
        return True

    def _take_seq(self, slot: Slot, seq: int, now: float | None) -> bool:
        """Accept `seq` for `slot` unless taken, too old to tell, or absurdly far ahead."""
        if seq in slot.gaps:
            slot.gaps.discard(seq)
            self._note_gaps(slot)
            return True
        if seq <= slot.last_seq:
            self.refused_duplicate += 1
            self.rejected["batch_duplicate_seq"] += 1
            return False
        away = 0.0 if now is None or slot.last_at is None else max(now - slot.last_at, 0.0)
        slack = MAX_SEQ_AHEAD + int(away * SEQ_AHEAD_PER_S)
        if seq > slot.last_seq + slack:
            self.rejected["batch_seq_too_far_ahead"] += 1
            return False
        skipped = range(max(slot.last_seq + 1, seq - SEQ_WINDOW), seq)
        slot.last_seq = seq
        if now is not None:
            slot.last_at = now
        if skipped or slot.gaps:  # in order and none missing (the rule): the record stands
            slot.gaps.update(skipped)
            if slot.gaps and min(slot.gaps) <= seq - SEQ_WINDOW:
                slot.gaps = {q for q in slot.gaps if q > seq - SEQ_WINDOW}
            self._note_gaps(slot)
        return True

    def resume_at(self, rank: int, incarnation: int, last_seq: int) -> None:
        """`rank`'s slot as its process says it is (a supervisor that lost its journal): that
        incarnation, running, every report up to `last_seq` answered."""
        slot = self.slots[rank]
        slot.incarnation, slot.last_seq, slot.last_at = incarnation, last_seq, None
        slot.state = SlotState.RUNNING
        slot.gaps.clear()
        self._note_gaps(slot)

    def _note_gaps(self, slot: Slot) -> None:
        slot.dirty = True  # its gaps may have changed in place
        if slot.gaps:
            self._incomplete.add(slot.rank)
        else:
            self._incomplete.discard(slot.rank)

    def answered_below(self, rank: int, seq: Any, below: Any) -> int:
        """A batch `seq` of `rank` says every number below `below` was answered (its
        `unanswered_from`, `supervisor.reporter`): stop awaiting those still missing.

        Only a node agent that answered a batch and died before sending it on
        leaves such a number (or a report that failed at the rank, its contents
        sent again under a new number). A value that is not an int, or above the
        batch's own number, is refused (counted) and changes nothing. Returns how
        many numbers were given up.
        """
        if below is None:
            return 0  # a sender that does not say (a single-process Guard, an old client)
        if unanswered_from(seq, below) is None:
            self.rejected["batch_unanswered_from"] += 1
            return 0
        return self.give_up_gaps(rank, below)

    def give_up_gaps(self, rank: int, below: int) -> int:
        """Numbers of `rank` below `below` not taken yet will never come: stop awaiting them.
        Returns how many."""
        slot = self.slots.get(rank)
        if slot is None:
            return 0
        lost = {q for q in slot.gaps if q < below}
        if lost:  # the common case is none: the slot's record stays as it was
            slot.gaps -= lost
            self._note_gaps(slot)
        return len(lost)

    def incomplete(self) -> frozenset[int]:
        """Ranks with batch numbers below their newest still missing (not yet arrived)."""
        return frozenset(self._incomplete)

    def lose(self, rank: int) -> None:
        """The rank's process is hung or dead: its reports no longer count."""
        self.slots[rank].state = SlotState.LOST

    def replace(self, rank: int) -> int:
        """Open the slot for a new process; return its incarnation."""
        slot = self.slots[rank]
        slot.incarnation += 1
        slot.state = SlotState.STARTING
        slot.last_seq = 0
        slot.gaps = set()
        self._note_gaps(slot)
        slot.last_at = None
        slot.pid = None
        slot.node = None
        return slot.incarnation

    def incarnation(self, rank: int) -> int:
        return self.slots[rank].incarnation

    @property
    def incarnations(self) -> Incarnations:
        """rank -> the incarnation of its current process, read live from the slots."""
        return Incarnations(self.slots)

    def end(self, rank: int) -> None:
        self.slots[rank].state = SlotState.ENDED

    def on_node(self, node_id: str, *, lost_too: bool = False) -> list[int]:
        """The ranks whose current process runs on node `node_id`, not ended (nor lost, unless
        `lost_too`: a lost rank keeps its node until its slot is opened for a replacement)."""
        states = {SlotState.STARTING, SlotState.RUNNING}
        if lost_too:
            states.add(SlotState.LOST)
        return [r for r, s in self.slots.items() if s.node == node_id and s.state in states]

    def live(self) -> list[int]:
        return [r for r, s in self.slots.items() if s.state is not SlotState.LOST]

    def records(self) -> list[dict[str, Any]]:
        """Each slot's whole record (`last_seq` in it), in rank order."""
        return [self.slots[rank].to_dict() for rank in sorted(self.slots)]

    def state_records(self) -> list[dict[str, Any]]:
        """Each slot's record for a state record, in rank order: all but `last_seq`. A slot
        whose record is unchanged since the last call gives the same dict again
        (`run_state.StateLog` then skips it by identity); none is changed after it is given
        out. A report moves only `last_seq`, so at thousands of ranks nearly every record is
        given again."""
        out = []
        cache = self._records
        for rank in sorted(self.slots):
            s = self.slots[rank]
            record = cache.get(rank)
            if record is None or s.dirty:
                record = cache[rank] = s.state_dict()
                s.dirty = False
            out.append(record)
        return out

    def sections(self) -> tuple[SlotSection, ...]:
        """The slots as the record's typed section, in rank order; a slot unchanged since the
        last call gives the same section again (its JSON form is `state_records`')."""
        out = []
        cache = self._sections
        for record in self.state_records():
            rank = record["rank"]
            section = cache.get(rank)
            if section is None or section.given is not record:
                section = replace(SlotSection.from_json(record), given=record)
                cache[rank] = section
            out.append(section)
        return tuple(out)

    def seqs(self) -> dict[int, int]:
        """rank -> its slot's `last_seq`: the part of the slots that every report moves, as
        plain numbers (`StateLog` compares them by value)."""
        return {rank: s.last_seq for rank, s in self.slots.items()}


class Incarnations(Mapping[int, int]):
    """A read-only view of each slot's incarnation (what a hang check's answers are about)."""

    def __init__(self, slots: Mapping[int, Slot]) -> None:
        self._slots = slots

    def __getitem__(self, rank: int) -> int:
        return self._slots[rank].incarnation

    def __iter__(self) -> Iterator[int]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)


def unanswered_from(seq: Any, below: Any) -> int | None:
    """A batch's `unanswered_from` if it can be one: an int, not above the batch's own number."""
    if type(below) is not int or (type(seq) is int and below > seq):
        return None
    return below
