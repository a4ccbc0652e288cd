"""Which step records of a rank never reached the supervisor: holes in the ticks it received.

A batch number the supervisor gives up on (`RankSlots.answered_below`) is
not a lost step record by itself: its contents may have reached the
supervisor before this one took over (a restarted supervisor resumes from a
state record older than the last batches its predecessor took), or gone out
again in a later batch. What is really missing shows in the records: each
process of a rank reports one record per step it runs, its ticks in order, so
a record whose tick is past the one expected next leaves the ticks between
missing (a held batch that dropped its oldest records while the supervisor
was away, a report that failed with its records). `RecordHoles` counts them
per rank process; `history.jsonl`'s `batches_lost` is written only where
some are (`RunCore`).

The first record seen of a process sets where it is (a replacement starts at
the tick it adopted; a restarted supervisor knows nothing before its first
batch), so nothing is ever counted missing that was not expected. No Ray,
no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class RecordHoles:
    """The tick each rank process's next step record should carry, and the holes before it."""

    def __init__(self) -> None:
        self._next: dict[int, tuple[Any, int]] = {}  # rank -> (incarnation, next tick)

    def take(self, rank: int, incarnation: Any, records: Iterable[Any]) -> int:
        """The step records of `rank` missing before or among `records` (one batch's, in
        order); a record of an older tick (sent again) fills nothing and counts nothing."""
        ticks = [t for t in map(_tick, records) if t is not None]
        if not ticks:
            return 0
        known = self._next.get(rank)
        expected = known[1] if known is not None and known[0] == incarnation else None
        missing = 0
        for tick in ticks:
            if expected is not None and tick > expected:
                missing += tick - expected
            expected = tick + 1 if expected is None else max(expected, tick + 1)
        assert expected is not None
        self._next[rank] = (incarnation, expected)
        return missing


def _tick(record: Any) -> int | None:
    if not isinstance(record, Mapping):
        return None
    tick = record.get("tick", record.get("step"))
    return tick if type(tick) is int and tick >= 0 else None
