"""The remedy CLI validates its inputs before any training starts and reports them precisely."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remedy.cli.main import main

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"


def remedy(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remedy.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=cwd or REPO,
    )


def test_malformed_policy_fails_before_training(tmp_path: Path) -> None:
    """`remedy run` with a malformed policy prints FILE:LINE:COL and exits 2 without starting a run."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: 1\nrules:\n  - name: x\n    when: {anomaly: nonfinite_los}\n    do: [rollback]\n"
    )
    run_dir = tmp_path / "run"
    proc = remedy("run", TARGET, "--policy", str(bad), "--run-dir", str(run_dir))
    assert proc.returncode == 2
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith(f"{bad}:4:")
    assert "error:" in first and "nonfinite_los" in first
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists(), "nothing may start before the policy is valid"


def test_malformed_chaos_file_fails_before_training(tmp_path: Path) -> None:
    """A chaos file with an unknown fault is rejected with its location, exit 2."""
    chaos = tmp_path / "chaos.yaml"
    chaos.write_text("faults:\n  - {kind: nan_lose, at_step: 3}\n")
    proc = remedy("run", TARGET, "--chaos", str(chaos))
    assert proc.returncode == 2
    assert "faults.0.kind" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_target_is_a_usage_error() -> None:
    """A target without ':function' or naming a missing file exits 2 with a clear message."""
    assert main(["run", "examples/pretrain_gpt.py"]) == 2
    assert main(["run", "examples/nope.py:main"]) == 2


def test_chaos_list_names_faults(capsys: pytest.CaptureFixture[str]) -> None:
    """`remedy chaos list` lists the injectable faults with a description."""
    assert main(["chaos", "list"]) == 0
    out = capsys.readouterr().out
    for kind in ("nan_loss", "loss_spike", "nan_grad", "grad_explosion"):
        assert kind in out


def test_report_prints_summary_and_decisions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`remedy report RUN_DIR` prints the run's status and each journaled decision."""
    (tmp_path / "summary.json").write_text(
        json.dumps(
            {
                "run_id": "r1",
                "status": "completed",
                "steps_completed": 10,
                "steps_executed": 12,
                "goodput": 10 / 12,
                "final_loss": 1.5,
                "anomalies": {"nonfinite_loss": 1},
                "wall_s": 3.0,
            }
        )
    )
    decision = {
        "outcome": "applied",
        "step": 5,
        "rule": "nan-rollback",
        "action": "rollback",
        "reason": "NaN seen.",
    }
    (tmp_path / "decisions.jsonl").write_text(json.dumps(decision) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "completed" in out and "nan-rollback: rollback" in out and "NaN seen." in out
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_policy_check_bundled_policies_pass() -> None:
    """`remedy policy check` accepts every bundled policy."""
    files = sorted(str(p) for p in (REPO / "src" / "remedy" / "policies").glob("*.yaml"))
    assert files
    assert main(["policy", "check", *files]) == 0


def test_policy_check_folder_reports_every_broken_file(capsys: pytest.CaptureFixture[str]) -> None:
    """`remedy policy check FOLDER` checks each policy in it: one located error per broken file, exit 1."""
    folder = REPO / "tests" / "policies" / "broken"
    assert main(["policy", "check", str(folder)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    broken = sorted(folder.glob("*.yaml"))
    assert len(broken) >= 15
    assert len(lines) == len(broken)
    for line, path in zip(lines, broken, strict=True):
        assert line.startswith(f"{path}:")
        assert ": error: " in line
