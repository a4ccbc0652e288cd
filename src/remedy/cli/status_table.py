"""`remedy status` with no run id: this user's recent runs, one line each, newest first.

The registry (`~/.remedy/runs`, this user's) holds every run ever started
here; printing each as a JSON line of its full status asked every live
supervisor and read every journal (29 runs took 18.9 s). The table reads
what is cheap: an ended run's `summary.json`; a live run's supervisor is
asked only for the runs shown. `RECENT` runs by default, `--all` for every
one, `--json` for the JSON lines of before (one run's full status each).

Pure but for the clock: entries and statuses in, text out.
"""

from __future__ import annotations

import time
from typing import Any

# Runs the table shows without --all.
RECENT = 10
COLUMNS = ("RUN ID", "STATE", "STEP", "LOSS", "STARTED", "RUN DIR")


def started_at(entry: dict[str, Any]) -> float:
    """When the run was started (its entry's `started`; 0 if unknown)."""
    value = entry.get("started")
    return float(value) if isinstance(value, int | float) else 0.0


def newest_first(entries: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """The entries by start time, newest first, at most `limit` (None: all)."""
    ordered = sorted(entries, key=started_at, reverse=True)
    return ordered if limit is None else ordered[:limit]


def row(status: dict[str, Any], entry: dict[str, Any], now: float) -> tuple[str, ...]:
    """One run's line: a status as `remedy status RUN_ID` gives it, and its registry entry."""
    steps = status.get("step")
    step = (
        str(max((v for v in steps.values() if isinstance(v, int)), default="-"))
        if isinstance(steps, dict)
        else "-"
    )
    loss = status.get("loss")
    state = str(status.get("state") or "-")  # why a run is unreachable: `remedy status RUN_ID`
    return (
        str(status.get("run_id") or entry.get("run_id")),
        state,
        step,
        f"{loss:.4f}" if isinstance(loss, float) else "-",
        _ago(now - started_at(entry)) if started_at(entry) else "-",
        str(entry.get("run_dir") or "-"),
    )


def render(rows: list[tuple[str, ...]], *, hidden: int) -> str:
    """The table, and how many older runs `--all` would add."""
    widths = [max(len(c), *(len(r[k]) for r in rows)) for k, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)).rstrip()]
    lines.extend(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
    if hidden:
        lines.append(f"({hidden} older run{'s' if hidden > 1 else ''}: remedy status --all)")
    return "\n".join(lines)


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{max(seconds, 0):.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h ago"
    return time.strftime("%Y-%m-%d", time.localtime(time.time() - seconds))
