"""What `remedy explain` says of a run's supervisor deaths, and of the Ray logs kept for it.

Each restarted supervisor journals how the one before it died
(`supervisor_died` in `history.jsonl`: its pid, Ray's exit type and detail,
and its `cause` and `reason` in words); a run that failed or whose
supervisor died keeps its private Ray's logs in `logs/` (`rundir.ray_logs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remedy.rundir.journals import read_journal
from remedy.rundir.ray_logs import LOGS_DIR, read_index


def death_lines(path: Path) -> list[str]:
    """One line per supervisor death of the run at `path` (with its kept logs), and one for
    the logs folder; none for a run where neither happened."""
    kept = [f for f in read_index(path) if f.get("kept")]
    lines = []
    for record in read_journal(path / "history.jsonl"):
        if record.get("type") == "supervisor_died":
            lines.append(_death_line(record, kept))
    if kept:
        lines.append(
            f"Ray logs of the run kept in {path / LOGS_DIR} ({len(kept)} file(s); "
            "index.json says which process wrote each)"
        )
    return lines


def _death_line(record: dict[str, Any], kept: list[dict[str, Any]]) -> str:
    pid = record.get("pid")
    reason = record.get("reason") or (
        f"Ray says {record.get('exit_type')}: {record.get('exit_detail')}"
        if record.get("exit_type")
        else record.get("exit_detail") or "unknown"
    )
    line = f"supervisor {record.get('incarnation')} (pid {pid}) died: {reason}"
    own = [str(f.get("name")) for f in kept if pid is not None and f.get("pid") == pid]
    if own:
        line += f"; its logs: {', '.join(f'{LOGS_DIR}/{name}' for name in own)}"
    return line
