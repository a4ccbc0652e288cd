"""Read a run directory back, whatever became of the run.

A completed or aborted supervised run has `summary.json`; a run that is
still going, one whose supervisor died, and a standalone run (a Guard given
`run_dir=`) have only the journals. `load_run` reads what is there and
derives the summary's totals from the journals where the file is missing, so
reports and `explain` work the same on all of them.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remedy.protocol.exceptions import SupervisorError
from remedy.rundir.headline import status_words
from remedy.rundir.journals import goodput_of, read_journal
from remedy.rundir.missing import missing_files
from remedy.rundir.read import read_records, read_run_dir
from remedy.rundir.writer import metrics_paths

# A run directory whose journals changed this recently is taken to be running.
RUNNING_WITHIN_S = 60.0
JOURNALS = ("decisions.jsonl", "anomalies.jsonl", "metrics.jsonl")
STANDALONE_RUN_ID = "local"  # WorkerContext's run_id when no supervisor set one


class RunDirError(SupervisorError):
    """The path is not a run directory (none of its files are there)."""


@dataclass
class RunData:
    """One run's journals and summary, as read from its directory."""

    path: Path
    summary: dict[str, Any]
    decisions: list[dict[str, Any]]
    anomalies: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    # "summary.json" when the run wrote one, else "journals" (running, crashed or standalone).
    summary_source: str
    problems: list[str] = field(default_factory=list)  # what could not be read, and why
    summary_corrupt: bool = False  # summary.json missing, unreadable or of the wrong shape
    # How each notify delivery ended (`notifications.jsonl`, see `supervisor.notify`).
    notifications: list[dict[str, Any]] = field(default_factory=list)

    @property
    def status(self) -> str:
        return str(self.summary.get("status", "unknown"))

    def ranks(self) -> list[int]:
        return sorted({int(m["rank"]) for m in self.metrics if isinstance(m.get("rank"), int)})

    def metrics_of(self, rank: int) -> list[dict[str, Any]]:
        """One rank's records in execution order (by tick)."""
        rows = [m for m in self.metrics if m.get("rank") == rank]
        return sorted(rows, key=lambda m: int(m.get("tick", m.get("step", 0))))


def number(value: Any) -> float | None:
    """A journal value as a float: "nan"/"inf" strings become floats, anything else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def load_run(path: str | Path) -> RunData:
    """Everything a report needs from `path`; raises `RunDirError` if it holds no run.

    Damaged files never stop a report: what can be read is used, and each
    problem (corrupt JSON, wrong types, skipped lines) is named in `problems`.
    """
    p = Path(path)
    files = read_run_dir(p)
    if files.missing:
        raise RunDirError(files.missing)
    decisions = sorted(files.decisions, key=lambda d: str(d.get("decision_id", "")))
    anomalies = read_records(p / "anomalies.jsonl", files)
    metrics = [m for path in metrics_paths(p) for m in read_records(path, files)]
    notifications = read_records(p / "notifications.jsonl", files)
    if (p / "summary.json").is_file():
        summary, source = files.summary, "summary.json"
        files.problems += missing_files(
            p, summary, decisions=len(decisions), anomalies=len(anomalies),
            metrics=len(metrics), metrics_files=metrics_paths(p),
        )  # fmt: skip
    else:
        summary, source = derive_summary(p, decisions, anomalies, metrics), "journals"
    return RunData(
        p,
        summary,
        decisions,
        anomalies,
        metrics,
        source,
        files.problems,
        files.summary_corrupt,
        notifications,
    )


def derive_summary(
    path: Path,
    decisions: list[dict[str, Any]],
    anomalies: list[dict[str, Any]],
    metrics: list[dict[str, Any]],
) -> dict[str, Any]:
    """The summary's totals, computed from the journals of a run that wrote no summary.json."""
    newest = max(
        ((path / name).stat().st_mtime for name in JOURNALS if (path / name).is_file()),
        default=0.0,
    )
    running = time.time() - newest < RUNNING_WITHIN_S
    lead = sorted(
        (m for m in metrics if m.get("rank", 0) == 0), key=lambda m: int(m.get("tick", 0))
    )
    # The lead's records in the order they were run (a full-group restart sets ticks back).
    ledger = goodput_of(path, metrics=metrics, anomalies=anomalies)
    completed = ledger.steps if ledger.executed else int(lead[-1]["step"]) + 1 if lead else 0
    executed = int(lead[-1].get("tick", lead[-1]["step"])) + 1 if lead else 0
    wall = _wall_s(metrics)
    started = ledger.first_start or 0.0
    goodput = ledger.summary(
        started=started,
        ended=ledger.last_end or started + wall,
        completed=completed,
        fallback_executed=executed,
    )
    losses = [
        x for m in lead[-10:] if (x := number(m.get("loss"))) is not None and math.isfinite(x)
    ]
    run_id = next(
        (r["run_id"] for r in [*decisions, *anomalies] if isinstance(r.get("run_id"), str)),
        path.name,
    )
    # A Guard run alone (no supervisor) journals under the worker context's default id.
    standalone = run_id == STANDALONE_RUN_ID
    return {
        "run_id": run_id,
        "status": "running" if running else "unfinished",
        "standalone": standalone,
        "steps_completed": completed,
        **goodput,
        "final_loss": sum(losses) / len(losses) if losses else None,
        "actions": dict(Counter(d["action"] for d in decisions if d.get("outcome") == "applied")),
        "anomalies": dict(Counter(str(a.get("kind")) for a in anomalies)),
        "outcomes": dict(Counter(str(d.get("outcome")) for d in decisions)),
        "decisions": len(decisions),
        "workers": len({m.get("rank") for m in metrics}) or 1,
        "wall_s": wall,
        "policy": _started_policy(path),
    }


def write_fallback_summary(run_dir: str | Path, run_id: str, reason: str, **extra: Any) -> Path:
    """summary.json of a run whose supervisor cannot write it (its Ray went away, or it was
    lost for good): status `failed`, the totals from its journals, and why.

    A summary its supervisor wrote before is kept as it is.
    """
    import json  # noqa: PLC0415 - only this rare path writes
    import os  # noqa: PLC0415

    path = Path(run_dir) / "summary.json"
    if path.exists():
        return path
    try:
        summary = dict(load_run(run_dir).summary)
    except RunDirError:
        summary = {"run_id": run_id}
    summary.update(status="failed", stop_reason=reason, **extra)
    tmp = path.with_name(".summary.json.tmp")
    try:
        tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise SupervisorError(f"cannot write {path}: {exc.strerror}") from None
    return path


def _started_policy(path: Path) -> str | None:
    """The policy the run's supervisor was started with, from its history, or None."""
    started = [
        r["policy"]
        for name in ("journal.wal", "history.jsonl")  # journal.wal: runs before state schema 8
        for r in read_journal(path / name)
        if r.get("type") == "supervisor_started" and isinstance(r.get("policy"), str)
    ]
    return started[-1] if started else None


def _wall_s(metrics: list[dict[str, Any]]) -> float:
    stamps = [m["ts"] for m in metrics if isinstance(m.get("ts"), str)]
    if len(stamps) < 2:
        return 0.0
    from datetime import datetime  # noqa: PLC0415 - only for runs without a summary

    first, last = (
        datetime.fromisoformat(s.replace("Z", "+00:00")) for s in (stamps[0], stamps[-1])
    )
    return round((last - first).total_seconds(), 2)


def status_line(run: RunData) -> str:
    """How the run stands, in words, for the top of a report."""
    if run.summary_source == "summary.json":
        return status_words(run.summary)
    if run.summary.get("standalone"):
        return "standalone run (a Guard without a supervisor writes no summary.json); " + (
            "its journals changed in the last minute" if run.status == "running" else "ended"
        )
    if run.status == "running":
        return "running (no summary.json yet; its journals changed in the last minute)"
    return "unfinished (no summary.json: its supervisor stopped before the run ended)"
