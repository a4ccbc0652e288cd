"""`remedy status` with no run id: this user's recent runs in a table, newest first, ten unless
`--all`; `--json` gives the JSON lines. Ended runs only: read from their run directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remedy.cli import status_table
from remedy.cli.main import main


@pytest.fixture
def twelve_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A registry of 12 ended runs, run-00 started first; each with its summary.json."""
    home = tmp_path / "home"
    monkeypatch.setenv("REMEDY_HOME", str(home))
    runs = home / "runs"
    runs.mkdir(parents=True)
    for i in range(12):
        run_dir = tmp_path / f"run-{i:02d}"
        run_dir.mkdir()
        status = "degraded" if i == 11 else "completed"
        summary = {"run_id": f"run-{i:02d}", "status": status, "final_loss": 1.0 + i / 100,
                   "ranks": [{"rank": 0, "steps_completed": 100 + i}]}  # fmt: skip
        (run_dir / "summary.json").write_text(json.dumps(summary))
        entry = {"run_id": f"run-{i:02d}", "run_dir": str(run_dir), "state": status,
                 "started": 1_000_000.0 + i, "mode": "cluster"}  # fmt: skip
        (runs / f"run-{i:02d}.json").write_text(json.dumps(entry))
    return tmp_path


def test_the_recent_runs_newest_first_in_a_table(
    twelve_runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ten runs, newest first, one line each with its state, step and loss; the two older ones
    are counted, not shown."""
    assert main(["status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "ID", "STATE", "STEP", "LOSS", "STARTED", "RUN", "DIR"]
    ids = [line.split()[0] for line in lines[1:11]]
    assert ids == [f"run-{i:02d}" for i in range(11, 1, -1)]
    assert lines[1].split()[1:4] == ["degraded", "111", "1.1100"]
    assert lines[-1] == "(2 older runs: remedy status --all)"


def test_all_and_json(twelve_runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--all` shows every run; `--json` one JSON line per run, as before."""
    assert main(["status", "--all"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 13
    assert main(["status", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["run_id"] for r in records][:2] == ["run-11", "run-10"] and len(records) == 10
    assert records[0]["state"] == "degraded"


def test_newest_first_without_a_start_time_sorts_last() -> None:
    """An entry with no start time known sorts after those with one."""
    entries = [{"run_id": "a"}, {"run_id": "b", "started": 5.0}, {"run_id": "c", "started": 9.0}]
    assert [e["run_id"] for e in status_table.newest_first(entries, 2)] == ["c", "b"]
