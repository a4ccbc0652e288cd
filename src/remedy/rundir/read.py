"""Read a run directory for `remedy report`, whatever state its files are in.

A run killed mid-write leaves a truncated last line; a disk error or a
person's editor can leave anything. What can be read is reported, and each
thing that cannot is named (file, line, why) instead of failing the report.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remedy.rundir import jsonl, names
from remedy.rundir.jsonl import Damaged

# Larger summaries or journals are not run files; read no more than this of each.
MAX_FILE_BYTES = 256 << 20
# Problems named one by one before the rest are counted.
MAX_NAMED_PROBLEMS = 5
# Damaged lines of one file named each as FILE:LINE before the rest are only counted.
MAX_LINES_NAMED = 20

_NUMBERS = ("steps_completed", "steps_executed", "goodput", "wall_s")
_TEXTS = ("outcome", "rule", "action", "reason")


@dataclass
class RunFiles:
    summary: dict[str, Any] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    summary_corrupt: bool = False
    missing: str | None = None


def read_run_dir(run_dir: Path) -> RunFiles:
    """The summary and decisions of `run_dir`, normalized so a report can always be printed."""
    out = RunFiles()
    summary_path = run_dir / names.SUMMARY
    try:
        if not run_dir.is_dir():
            what = "does not exist" if not run_dir.exists() else "is not a directory"
            out.missing = f"{run_dir} {what} (give a run directory, e.g. runs/<run_id>)"
            return out
        in_progress = not summary_path.is_file() and any(
            (run_dir / name).is_file() for name in names.RUN_FILES
        )
        if not summary_path.is_file() and not in_progress:
            out.missing = f"{summary_path} not found (is {run_dir} a run directory?)"
            return out
    except OSError as exc:
        out.missing = f"{run_dir}: {exc.strerror}"
        return out
    if in_progress:
        out.problems.append(
            f"{summary_path} not written: the run is still going, or ended before writing it "
            "(see `remedy status`); showing its decisions so far"
        )
        out.summary_corrupt = True
        raw = None
    else:
        raw = _read_json(summary_path, out)
    if raw is not None and not isinstance(raw, dict):
        out.problems.append(f"{summary_path}: not a JSON object")
        out.summary_corrupt, raw = True, None
    out.summary = _normal_summary(raw or {}, run_dir, out)
    out.decisions = _read_decisions(run_dir / names.DECISIONS, out)
    return out


def _read_text(path: Path, out: RunFiles) -> str | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        out.problems.append(f"{path}: cannot read ({exc.strerror})")
        return None
    if len(data) > MAX_FILE_BYTES:
        out.problems.append(f"{path}: larger than {MAX_FILE_BYTES} bytes; read the first part only")
        data = data[:MAX_FILE_BYTES]
    return data.decode("utf-8", errors="replace")


def _read_json(path: Path, out: RunFiles) -> Any:
    text = _read_text(path, out)
    if text is None:
        out.summary_corrupt = True
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        where = (
            f"line {exc.lineno} column {exc.colno}: "
            if isinstance(exc, json.JSONDecodeError)
            else ""
        )
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        out.problems.append(f"{path}: corrupt JSON ({where}{msg}); showing what else can be read")
        out.summary_corrupt = True
        return None


def _normal_summary(raw: dict[str, Any], run_dir: Path, out: RunFiles) -> dict[str, Any]:
    """The summary with every field a report prints of the documented type; wrong ones are named."""
    summary = dict(raw)
    wrong: list[str] = []
    for key in ("run_id", "status"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            wrong.append(key)
    summary["run_id"] = str(raw.get("run_id") or run_dir.name)
    summary["status"] = str(raw.get("status") or "unknown")
    for key in _NUMBERS:
        value = raw.get(key)
        summary[key] = _number(value)
        if value is not None and summary[key] != value:
            wrong.append(key)
    loss = raw.get("final_loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, int | float)):
        # A NaN loss is a fact about the run (it diverged), not a corrupt file.
        summary["final_loss"] = None
        wrong.append("final_loss")
    for key in ("anomalies", "actions", "outcomes"):
        value = raw.get(key)
        summary[key] = {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}
        if value is not None and not isinstance(value, dict):
            wrong.append(key)
    wrong.extend(_normal_goodput(raw, summary))
    if not isinstance(raw.get("ranks", []), list):
        summary["ranks"] = []
        wrong.append("ranks")
    if wrong:
        out.problems.append(
            f"{run_dir / 'summary.json'}: wrong type or value for {', '.join(wrong)}"
        )
        out.summary_corrupt = True
    return summary


def _normal_goodput(raw: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """The goodput fields (`steps_kept`, `ettr`, `time_kept_s`, `time_lost`,
    `time_lost_by_cause`) where present, of their documented types; the wrong ones' names."""
    wrong: list[str] = []
    for key in ("steps_kept", "time_kept_s", "ettr"):
        if key in raw and not (key == "ettr" and raw[key] is None):
            summary[key] = _number(raw[key])
            if summary[key] != raw[key]:
                wrong.append(key)
    if "time_lost" in raw:
        rows = raw["time_lost"]
        good = [r for r in rows if _lost_row(r)] if isinstance(rows, list) else []
        summary["time_lost"] = good
        if not isinstance(rows, list) or len(good) != len(rows):
            wrong.append("time_lost")
    if "time_lost_by_cause" in raw:
        causes = raw["time_lost_by_cause"]
        ok = isinstance(causes, dict) and all(
            _number(v) == v and not isinstance(v, bool) for v in causes.values()
        )
        summary["time_lost_by_cause"] = {str(k): v for k, v in causes.items()} if ok else {}
        if not ok:
            wrong.append("time_lost_by_cause")
    return wrong


def _lost_row(row: Any) -> bool:
    return (
        isinstance(row, dict)
        and isinstance(row.get("what"), str)
        and (row.get("cause") is None or isinstance(row.get("cause"), str))
        and type(row.get("steps")) is int
        and _number(row.get("seconds")) == row.get("seconds")
        and not isinstance(row.get("seconds"), bool)
    )


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return value if math.isfinite(value) else 0


def read_records(path: Path, out: RunFiles) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; corrupt lines are skipped and named in `out`."""
    if not path.is_file():
        return []
    text = _read_text(path, out)
    if text is None:
        return []
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    for item in jsonl.scan_text(text, str(path)):
        if isinstance(item, Damaged):  # a torn last line too: the report says what it skipped
            _bad_line(path, item.line, item.why, bad, out)
        else:
            records.append(item)
    if bad:
        shown = ", ".join(str(n) for n in bad[:MAX_NAMED_PROBLEMS])
        more = f" and {len(bad) - MAX_NAMED_PROBLEMS} more" if len(bad) > MAX_NAMED_PROBLEMS else ""
        out.problems.append(f"{path}: {len(bad)} corrupt line(s) skipped (line {shown}{more})")
    return records


def _bad_line(path: Path, number: int, why: str, bad: list[int], out: RunFiles) -> None:
    """Name one damaged line as FILE:LINE (the first `MAX_LINES_NAMED` of a file; the count
    after them says how many in all)."""
    bad.append(number)
    if len(bad) <= MAX_LINES_NAMED:
        out.problems.append(f"{path}:{number}: damaged line skipped: {why}")


def _read_decisions(path: Path, out: RunFiles) -> list[dict[str, Any]]:
    decisions = read_records(path, out)
    for record in decisions:
        for key in _TEXTS:
            record[key] = str(record.get(key, "?"))
        step = record.get("step")
        record["step"] = step if isinstance(step, int) and not isinstance(step, bool) else "?"
        if record.get("decision_id") is not None:
            record["decision_id"] = str(record["decision_id"])
    return decisions
