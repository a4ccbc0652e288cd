"""A `remedy run` driver SIGKILLed mid-run: within the watchdog's bound no process of its private
Ray is left (Ray's agents stayed a minute or more before), its temporary directory is removed, the
run's Ray logs are in its run directory and its summary says `failed`, naming the driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remedy.cli.ray_watchdog import END_BOUND_S, processes_with
from tests.paths import PYTHONPATH
from tests.robustness.test_private_ray_dies import TINY

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

# The watchdog is woken by the driver's death at once; this allows for a loaded machine
# starting the Python that keeps the logs and writes the summary.
WATCHDOG_DONE_S = END_BOUND_S + 60


def test_a_killed_driver_leaves_no_private_ray_behind(tmp_path: Path) -> None:
    """SIGKILL of the driver: every process with the private Ray's token gone within the bound,
    its temp dir removed, the run's logs kept, the run marked failed."""
    run_dir = tmp_path / "run"
    home = tmp_path / "home"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "REMEDY_HOME": str(home)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "remedy.cli", "run", TINY, "--address", "local", "--workers", "2",
         "--run-dir", str(run_dir), "--quiet", "--", "--steps", "100000", "--sleep", "0.02"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr").open("w"), env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 20:
            said = (tmp_path / "stderr").read_text()[-2000:]
            assert proc.poll() is None and time.monotonic() < deadline, f"never trained: {said}"
            time.sleep(0.5)
        [entry_file] = (home / "runs").glob("*.json")
        entry = json.loads(entry_file.read_text())
        token, temp_dir = entry["ray_token"], Path(entry["temp_dir"])
        ray_pids = processes_with(token)
        assert len(ray_pids) >= 4, ray_pids  # the GCS, the raylet, the supervisor, the ranks
        assert temp_dir.is_dir()
    finally:
        proc.kill()
        proc.wait(timeout=60)
    killed = time.monotonic()
    left = processes_with(token)
    while left:
        assert time.monotonic() - killed < END_BOUND_S, f"left after {END_BOUND_S} s: {left}"
        time.sleep(0.1)
        left = processes_with(token)
    print(f"no process of the private Ray left {time.monotonic() - killed:.2f} s after the kill")
    summary_file = run_dir / "summary.json"
    while temp_dir.exists() or not summary_file.exists():
        assert time.monotonic() - killed < WATCHDOG_DONE_S, (temp_dir.exists(), summary_file)
        time.sleep(0.2)
    summary = json.loads(summary_file.read_text())
    assert summary["status"] == "failed", summary
    assert f"driver of remedy run (pid {proc.pid})" in summary["stop_reason"], summary
    index = json.loads((run_dir / "logs" / "index.json").read_text())
    roles = {f["role"] for f in index["files"] if f["kept"]}
    assert {"supervisor", "rank", "ray"} <= roles, index
    assert json.loads(entry_file.read_text())["state"] == "failed"


def test_a_driver_that_ends_normally_stands_its_watchdog_down(tmp_path: Path) -> None:
    """A run that completes: no watchdog, no Ray process and no temp dir stay, no logs copied."""
    run_dir = tmp_path / "run"
    home = tmp_path / "home"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "REMEDY_HOME": str(home)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-m", "remedy.cli", "run", TINY, "--address", "local",
         "--run-dir", str(run_dir), "--quiet", "--", "--steps", "20"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    [entry_file] = (home / "runs").glob("*.json")
    entry = json.loads(entry_file.read_text())
    assert not Path(entry["temp_dir"]).exists()
    assert not (run_dir / "logs").exists()
    watchdogs = [p for p in _pids() if b"ray_watchdog" in _cmdline(p) and _is_ours(p, tmp_path)]
    assert not watchdogs, watchdogs


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _is_ours(pid: int, tmp_path: Path) -> bool:
    """A process started in this test (its working directory is the test's)."""
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd")) == tmp_path
    except OSError:
        return False
