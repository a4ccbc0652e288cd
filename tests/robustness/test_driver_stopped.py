"""A `remedy run` driver SIGSTOPped for good: the run tied to it still trains to its end and writes
summary.json (the supervisor runs the run, the driver only watches); killing the stopped driver
then takes its private Ray with it, leaving nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import PYTHONPATH
from tests.robustness.test_private_ray_dies import TINY, _children

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_stopped_driver_does_not_stop_its_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": PYTHONPATH,
        "REMEDY_HOME": str(tmp_path / "home"),
    }
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "remedy.cli", "run", TINY, "--address", "local",
         "--run-dir", str(run_dir), "--quiet", "--", "--steps", "400", "--sleep", "0.02"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    children: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 150
        metrics = run_dir / "metrics.jsonl"
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 20:
            assert proc.poll() is None and time.monotonic() < deadline, "the run never trained"
            time.sleep(0.5)
        children = _children(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        summary_file = run_dir / "summary.json"
        deadline = time.monotonic() + 150
        while not summary_file.exists():
            assert time.monotonic() < deadline, "no summary while the driver was stopped"
            time.sleep(0.5)
        summary = json.loads(summary_file.read_text())
        assert summary["status"] == "completed", summary
        assert summary["steps_completed"] == 400
    finally:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.communicate(timeout=60)
    assert "raylet" in children.values() and "gcs_server" in children.values(), children
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in children):
        assert time.monotonic() < deadline, f"left behind: {_children(1)}"
        time.sleep(0.5)
