"""`remedy report` and `remedy explain` name every damaged line (FILE:LINE) and every missing file they read around."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remedy.cli.main import main
from remedy.report.explain import explain
from remedy.rundir.rundata import load_run


def _decision(n: int, step: int) -> str:
    return json.dumps({
        "decision_id": f"r-d{n:05d}", "step": step, "rule": "nan-rollback", "action": "rollback",
        "outcome": "applied", "reason": "nonfinite_loss on rank 0", "params": {},
        "anomaly": {"kind": "nonfinite_loss", "rank": 0, "step": step},
        "event": "decision", "run_id": "r",
    })  # fmt: skip


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run's directory as its supervisor leaves it: 3 decisions, 2 anomalies, 4 steps."""
    path = tmp_path / "run"
    path.mkdir()
    summary = {
        "run_id": "r", "status": "completed", "steps_completed": 4, "steps_executed": 4,
        "goodput": 1.0, "wall_s": 1.0, "final_loss": 0.1, "decisions": 3,
        "actions": {"rollback": 3}, "outcomes": {"applied": 3}, "anomalies": {"nonfinite_loss": 2},
    }  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "decisions.jsonl").write_text("".join(_decision(n, 10 * n) + "\n" for n in (1, 2, 3)))
    anomaly = {"kind": "nonfinite_loss", "rank": 0, "step": 10, "event": "anomaly"}
    (path / "anomalies.jsonl").write_text((json.dumps(anomaly) + "\n") * 2)
    metrics = [{"step": s, "rank": 0, "loss": 0.1, "event": "metrics"} for s in range(4)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return path


def test_an_intact_run_gives_no_warning(run_dir: Path) -> None:
    """Nothing damaged, nothing missing: no problem named."""
    assert load_run(run_dir).problems == []


def test_a_damaged_decision_line_is_named_by_file_and_line(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torn line 2 of decisions.jsonl: explain and report say FILE:2, and that the file holds fewer than counted."""
    lines = (run_dir / "decisions.jsonl").read_text().splitlines()
    lines[1] = lines[1][:40]
    (run_dir / "decisions.jsonl").write_text("\n".join(lines) + "\n")
    text = explain(load_run(run_dir))
    assert f"{run_dir / 'decisions.jsonl'}:2: damaged line skipped: not JSON" in text
    assert f"{run_dir / 'decisions.jsonl'}: holds 2 decisions, though summary.json counts 3" in text
    assert main(["report", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert f"remedy: warning: {run_dir / 'decisions.jsonl'}:2: damaged line skipped" in err


def test_a_missing_decisions_file_is_named_not_taken_for_no_decisions(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """decisions.jsonl deleted while summary.json counts 3: explain says the file is missing."""
    (run_dir / "decisions.jsonl").unlink()
    assert main(["explain", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"{run_dir / 'decisions.jsonl'}: missing, though summary.json counts 3 decisions" in out


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("anomalies.jsonl", "missing, though summary.json counts 2 anomalies"),
        ("metrics.jsonl", "missing, though summary.json counts 4 steps completed"),
    ],
)
def test_other_missing_journals_are_named(run_dir: Path, name: str, line: str) -> None:
    """The anomalies and step records summary.json counts, deleted: each named."""
    (run_dir / name).unlink()
    assert f"{run_dir / name}: {line}" in load_run(run_dir).problems


def test_many_damaged_lines_are_named_up_to_a_bound_then_counted(run_dir: Path) -> None:
    """30 damaged lines: the first 20 named by line, then one count of all 30."""
    with (run_dir / "anomalies.jsonl").open("a") as fh:
        fh.write("{torn\n" * 30)
    problems = load_run(run_dir).problems
    named = [p for p in problems if ": damaged line skipped" in p]
    assert len(named) == 20 and named[0].startswith(f"{run_dir / 'anomalies.jsonl'}:3:")
    assert any("30 corrupt line(s) skipped" in p for p in problems)
