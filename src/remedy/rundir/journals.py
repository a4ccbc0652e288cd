"""Reading a run directory's journals back: the shell's side of what the decision core wrote.

The decision core (`supervisor.core`) reads and writes no file: what it
journals leaves as effects (`core.effects.Journal`), and what it resumes
from is handed to it as records. These are the readers the supervisor,
`remedy report` and `remedy status` use to hand it those records.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from remedy.control.goodput import GoodputLedger, ts_of
from remedy.rundir import jsonl
from remedy.rundir.jsonl import Damaged
from remedy.rundir.writer import metrics_paths


def read_journal(
    path: str | os.PathLike[str], skipped: list[int] | None = None
) -> list[dict[str, Any]]:
    """Every whole record of a journal; a torn or corrupt line (a crash mid-write) is skipped,
    and its number (from 1) added to `skipped` where given."""
    damaged: list[Damaged] = []
    out = list(jsonl.records(path, damaged=damaged))
    if skipped is not None:
        skipped.extend(d.line for d in damaged)
    return out


def goodput_of(
    path: str | os.PathLike[str],
    *,
    metrics: Iterable[Mapping[str, Any]] | None = None,
    anomalies: Iterable[Mapping[str, Any]] | None = None,
    lead: int = 0,
) -> GoodputLedger:
    """The goodput ledger of the run in `path`, rebuilt from its journals (`GoodputLedger.replay`);
    `metrics`/`anomalies` may be given when already read."""
    p = Path(path)
    if metrics is None:
        metrics = [m for f in metrics_paths(p) for m in read_journal(f)]
    return GoodputLedger.replay(
        # The history (journal.wal held it in runs before state schema 8).
        read_journal(p / "journal.wal") + read_journal(p / "history.jsonl"),
        metrics=metrics,
        anomalies=read_journal(p / "anomalies.jsonl") if anomalies is None else anomalies,
        lead=lead,
    )


def last_written(path: str | os.PathLike[str]) -> float | None:
    """The `ts` of the last whole line of a journal (when its writer was last heard of)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 65536))
            tail = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    # The tail's first line may be cut where it was read from: damaged, and skipped.
    whole = [r for r in jsonl.scan_text(tail) if isinstance(r, dict)]
    for record in reversed(whole):
        if (at := ts_of(record.get("ts"))) is not None:
            return at
    return None
