"""The private Ray's watchdog (`cli.ray_watchdog`) with real processes and no Ray: a driver
SIGKILLed leaves none of the processes holding its cluster's token, nor its temp dir, and its run
gets its logs and a `failed` summary; a driver that stands it down leaves everything to itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remedy.cli.ray_watchdog import END_BOUND_S, processes_with
from tests.paths import PYTHONPATH

pytestmark = pytest.mark.timeout(120)

# A driver: starts the watchdog, then a process of "its cluster" (one holding the token, in a
# session of its own as Ray's workers are, so that it outlives the driver), names its run, and
# either stands the watchdog down and exits, or waits to be killed.
DRIVER = """
import json, os, subprocess, sys, time
from remedy.cli import ray_watchdog
token, temp_dir, run_dir, mode = sys.argv[1:5]
dog = ray_watchdog.start(token, temp_dir)
member = subprocess.Popen(["sleep", "600"], env={**os.environ, "RAY_AUTH_TOKEN": token},
                          start_new_session=True)
dog.watch_run(run_dir, "20261207-000000-abcdef", workers=1)
print(json.dumps({"member": member.pid, "watchdog": dog.proc.pid}), flush=True)
if mode == "stand_down":
    dog.stand_down()
    sys.exit(0)
time.sleep(600)
"""


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], dict[str, int], str]:
    token = os.urandom(16).hex()
    temp = tmp_path / "remedy-ray-x"
    logs = temp / "session_2026-12-07_00-00-00_1_1" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.out").write_text("the raylet's last words\n")
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "REMEDY_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, token, str(temp), str(tmp_path / "run"), mode],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    pids = json.loads(proc.stdout.readline())
    return proc, pids, token


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_a_killed_driver_takes_its_cluster_and_temp_dir_with_it(tmp_path: Path) -> None:
    """SIGKILL of the driver: the token's process ends within the bound, the temp dir goes, the
    run directory gets the logs and a failed summary naming the driver, the watchdog exits."""
    (tmp_path / "run").mkdir()
    proc, pids, token = _start(tmp_path, "wait")
    assert processes_with(token) == [pids["member"]]
    proc.kill()
    proc.wait(timeout=30)
    killed = time.monotonic()
    while processes_with(token):
        assert time.monotonic() - killed < END_BOUND_S, processes_with(token)
        time.sleep(0.05)
    deadline = time.monotonic() + 60
    while not _gone(pids["watchdog"]):
        assert time.monotonic() < deadline, "the watchdog did not finish"
        time.sleep(0.1)
    assert _gone(pids["member"])
    assert not (tmp_path / "remedy-ray-x").exists()
    assert (tmp_path / "run" / "logs" / "raylet.out").read_text() == "the raylet's last words\n"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["workers"] == 1, summary
    assert f"the driver of remedy run (pid {proc.pid}) ended" in summary["stop_reason"]


def test_a_driver_that_stands_it_down_keeps_everything(tmp_path: Path) -> None:
    """stand_down, then the driver exits: the watchdog exits too and touches nothing."""
    (tmp_path / "run").mkdir()
    proc, pids, token = _start(tmp_path, "stand_down")
    try:
        assert proc.wait(timeout=30) == 0
        assert _gone(pids["watchdog"])
        assert processes_with(token) == [pids["member"]]
        assert (tmp_path / "remedy-ray-x").is_dir()
        assert not (tmp_path / "run" / "summary.json").exists()
        assert not (tmp_path / "run" / "logs").exists()
    finally:
        os.kill(pids["member"], signal.SIGKILL)


def test_status_names_a_temp_dir_left_behind(tmp_path: Path) -> None:
    """`remedy status RUN_ID` of an ended run whose private Ray's temp dir is still there (its
    driver and watchdog both killed) names it; once removed, it says nothing of it."""
    from remedy.cli.run_access import RunRef  # noqa: PLC0415
    from remedy.cli.run_commands import _status_of  # noqa: PLC0415

    run_dir, temp = tmp_path / "run", tmp_path / "remedy-ray-x"
    run_dir.mkdir()
    temp.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"run_id": "r1", "status": "failed"}))
    ref = RunRef("r1", {"run_dir": str(run_dir), "temp_dir": str(temp)})
    assert _status_of(ref)["ray_temp_dir_left"] == str(temp)
    temp.rmdir()
    assert "ray_temp_dir_left" not in _status_of(ref)
