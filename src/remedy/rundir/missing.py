"""Files a run's summary says hold records, but that are missing or hold fewer.

`remedy report` and `remedy explain` read around summary.json: the
decisions, anomalies and step records it counts. A journal that was deleted
or cut short would otherwise read as a run without them ("no decisions"
while summary.json counts 5 actions); each such file is named instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _count(value: Any) -> int:
    """A summary's count (an int), or the sum of a count by name (a dict of ints); else 0."""
    if type(value) is int:
        return value
    if isinstance(value, Mapping):
        return sum(v for v in value.values() if type(v) is int)
    return 0


def missing_files(
    path: Path,
    summary: Mapping[str, Any],
    *,
    decisions: int,
    anomalies: int,
    metrics: int,
    metrics_files: list[Path],
) -> list[str]:
    """One line per file summary.json says holds records that is missing or holds fewer.

    `decisions`, `anomalies`, `metrics`: how many records were read of each.
    """
    out: list[str] = []
    counted = max(_count(summary.get("decisions")), _count(summary.get("outcomes")),
                  _count(summary.get("actions")))  # fmt: skip
    out += _compare(path / "decisions.jsonl", decisions, counted, "decisions")
    out += _compare(path / "anomalies.jsonl", anomalies, _count(summary.get("anomalies")),
                    "anomalies")  # fmt: skip
    steps = _count(summary.get("steps_completed"))
    if steps > 0 and metrics == 0:
        present = [f for f in metrics_files if f.is_file()]
        where = present[0] if present else path / "metrics.jsonl"
        why = "holds no step record" if present else "missing"
        out.append(f"{where}: {why}, though summary.json counts {steps} steps completed")
    return out


def _compare(file: Path, read: int, counted: int, what: str) -> list[str]:
    if counted <= read:
        return []
    if not file.is_file():
        return [f"{file}: missing, though summary.json counts {counted} {what}"]
    return [f"{file}: holds {read} {what}, though summary.json counts {counted}"]
