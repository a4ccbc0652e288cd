"""Writing the decision core's journal effects into a run directory.

The Controller writes no file: what it journals leaves as `control.effects.Journal`
effects (`Controller.take_effects`). A shell writes them here, in the order they were
emitted, before it writes a state record or replies; the effects that are no journal
line (a `Notify`, a `GroupAction`) come back for the shell to carry out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from remedy.control.effects import (
    AnomalyRecord,
    DecisionRecord,
    Effect,
    HistoryRecord,
    MetricRecords,
)


class JournalFiles(Protocol):
    """The journals of a run directory (`rundir.writer.RunDir`)."""

    def history(self, record: dict[str, Any]) -> None: ...
    def decision(self, record: dict[str, Any]) -> None: ...
    def anomaly(self, record: dict[str, Any]) -> None: ...
    def metrics_many(self, records: list[dict[str, Any]]) -> None: ...


def write_journal(files: JournalFiles | None, effects: Iterable[Effect]) -> list[Effect]:
    """Write each `Journal` effect into `files` (None: nowhere), in order; return the rest."""
    rest: list[Effect] = []
    for effect in effects:
        match effect:
            case HistoryRecord(record):
                if files is not None:
                    files.history(record)
            case DecisionRecord(record):
                if files is not None:
                    files.decision(record)
            case AnomalyRecord(record):
                if files is not None:
                    files.anomaly(record)
            case MetricRecords(records):
                if files is not None:
                    files.metrics_many(records)
            case _:
                rest.append(effect)
    return rest
