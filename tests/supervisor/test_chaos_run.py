"""`remedy chaos run`: scenarios against a fault-free twin, the table, its JSON and the exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remedy.cli import chaos_run
from remedy.cli.main import main

REPO = Path(__file__).resolve().parents[2]
TINY = ('args: [--layers, "1", --width, "16", --block-size, "16", --batch-size, "4", '
        '--sample-every, "0", --snapshot-every, "5", --checkpoint-every, "10"]\n')  # fmt: skip


def scenario(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"workers: 1\nsteps: 40\n{TINY}{body}")
    return path


def test_every_scenario_is_checked_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad file among good ones: exit 2, its located errors, no run directory made."""
    good = scenario(tmp_path, "good", "faults: [{kind: nan_loss, at_step: 20}]\n")
    bad = scenario(tmp_path, "bad", "faults: [{kind: nan_loss, at_step: 20, rank: 3}]\n")
    out = tmp_path / "runs"
    assert main(["chaos", "run", str(good), str(bad), "--run-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4:46: error: faults.0.rank: rank 3 is outside the world of 1" in err
    assert not out.exists()
    missing = tmp_path / "nope.py:main"
    assert main(["chaos", "run", str(good), "--target", str(missing)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_bundled_scenarios_load_and_cover_every_fault() -> None:
    """examples/chaos/scenarios: every injectable fault, one rank and several, a random one."""
    from remedy.rank.chaos.faults import SUPPORTED_FAULTS  # noqa: PLC0415

    paths = sorted(str(p) for p in (REPO / "examples" / "chaos" / "scenarios").glob("*.yaml"))
    planned, errors = chaos_run.plan(paths, target=None, workers=None)
    assert errors == []
    kinds = {f.kind for p in planned for f in p.scenario.faults}
    assert kinds == SUPPORTED_FAULTS
    assert {p.job.workers for p in planned} == {1, 2}
    assert any(p.name == "random" and len(p.scenario.faults) >= 3 for p in planned)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_scenario_runs_against_its_twin_and_the_table_says_what_happened(
    ray_cluster: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN and a failed checkpoint write on one rank: both detected, answered, recovered; the
    final loss is the twin's within the tolerance; the JSON holds the same."""
    path = scenario(tmp_path, "nan", (
        "loss_tolerance: 0.2\nfaults:\n  - {kind: nan_loss, at_step: 25}\n"
        "  - {kind: checkpoint_write_error, at_step: 15}\n"
    ))  # fmt: skip
    out = tmp_path / "runs"
    code = main(["chaos", "run", str(path), "--run-dir", str(out)])
    table = capsys.readouterr().out
    assert code == 0, table
    report = json.loads((out / "chaos-run.json").read_text())
    assert report["recovered"] is True and report["command"].startswith("remedy chaos run")
    [s] = report["scenarios"]
    assert s["status"] == "completed" and s["twin_final_loss"] is not None
    rows = {r["fault"]: r for r in s["faults"]}
    nan = rows["nan_loss"]
    assert nan["detected_by"] == "nonfinite_loss" and nan["detected_after_steps"] == 0
    assert [d["action"] for d in nan["decisions"]] == ["rollback", "shrink_lr"]
    assert nan["steps_lost"] > 0 and nan["seconds_lost"] > 0
    write = rows["checkpoint_write_error"]
    assert write["detected_by"] == "checkpoint_write_failed"
    assert write["decisions"] == [{"action": "notify", "outcome": "applied",
                                   "rule": "checkpoint-write-failed"}]  # fmt: skip
    assert s["steps_executed"] > s["steps_kept"] == 40
    assert "nan_loss @25 rank 0" in table and "yes (nonfinite_loss, +0 steps" in table
    assert (out / "twin-1" / "summary.json").exists() and (out / "nan" / "summary.json").exists()


def test_a_fault_past_the_last_step_says_so_in_the_table(tmp_path: Path) -> None:
    """A fault scheduled after the run's last step: its row says it never fired because the
    run ended first, and the scenario's verdict names that (no run needed: the journals are
    read from an empty run directory)."""
    from remedy.rank.chaos.faults import load_scenario  # noqa: PLC0415

    path = scenario(tmp_path, "late", "faults:\n  - {kind: nan_loss, at_step: 60}\n")
    job = chaos_run.Job(target="t.py:main", workers=1, steps=40, args=(), policy="default")
    planned = chaos_run.Planned(scenario=load_scenario(path), job=job, name="late")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = {"status": "completed", "steps_completed": 40, "final_loss": 1.0}
    outcome = chaos_run.analyze(planned, run_dir, summary, run_dir, summary)
    [row] = outcome.rows
    assert row["fired"] is False and row["not_reached"] == 40
    table = chaos_run.table([outcome])
    assert "never fired: the run ended after step 39" in table
    assert "NO (a fault's step was past the run's last step)" in table
