"""`remedy run --workers 2`: a float16 overflow storm that outlasts the run ends it `degraded`,
exit 5, with the reason in summary.json and the closing lines; never `completed`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
ARGS = ["--steps", "40", "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0", "--amp", "fp16"]  # fmt: skip


@pytest.mark.timeout(300)
def test_a_storm_that_outlasts_the_run_is_degraded_exit_5(tmp_path: Path) -> None:
    """Every rank overflows from step 15 to the end: rescues are tried (and journaled), the
    last 25 steps learn nothing, and the run is degraded, exit 5, saying why."""
    chaos = tmp_path / "storm.yaml"
    chaos.write_text(
        "faults:\n  - {kind: scaler_overflow_storm, at_step: 15, duration: 100, rank: null}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}",
        HOME=str(tmp_path),
        REMEDY_HOME=str(tmp_path / ".remedy"),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
    )
    run_dir = tmp_path / "run"
    # No rank is lost: no warm spare to start (the default for 2 workers is one).
    argv = ["run", TARGET, "--workers", "2", "--spares", "0", "--run-dir", str(run_dir),
            "--chaos", str(chaos), "--", *ARGS]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "remedy.cli", *argv],
        capture_output=True, text=True, check=False, timeout=280, env=env,
    )  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert proc.returncode == 5, (proc.returncode, proc.stderr[-3000:])
    assert summary["status"] == "degraded"
    assert summary["degraded_reason"].startswith("rank 0: no learning in the last 20 steps")
    assert "every update was skipped" in summary["degraded_reason"]
    for rank in summary["ranks"]:
        assert rank["learning"]["updates_skipped"] == 25, rank["learning"]
    decisions = [
        json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()
    ]
    assert any(d["rule"] == "learning-rescue" for d in decisions), decisions
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["status"] == "degraded"
