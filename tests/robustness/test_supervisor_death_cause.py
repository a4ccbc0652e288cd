"""A `remedy run` whose supervisor is killed twice, once with `kill -9` and once by the kernel's OOM
killer (a memory cap on its process: a cgroup v1 memory limit, as a container's, and a 256 MB
argument to one of its calls): each restarted supervisor journals how the one before died
(`supervisor_died`: cause `signal`, then `oom_killer` quoting the kernel's line), `remedy explain`
says so, and the private Ray's logs, the dead supervisors' among them, are kept in the run
directory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from remedy.report.explain import explain
from remedy.rundir.claim import claimed_supervisors
from remedy.rundir.journals import read_journal
from remedy.rundir.rundata import load_run
from tests.paths import PYTHONPATH
from tests.robustness.test_private_ray_dies import TINY

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

WAIT_S = 300.0
# Joins the run's private Ray with its token and sends the supervisor a call whose argument its
# process must copy into its own memory.
BIG_CALL = """
import sys, ray
ray.init(address=sys.argv[1], logging_level=40, log_to_driver=False)
sup = ray.get_actor("remedy-supervisor-" + sys.argv[2], namespace="remedy")
try:
    ray.get(sup.status.remote(b"x" * (256 << 20)), timeout=180)
except Exception as exc:
    print(type(exc).__name__)
"""


def _memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory folder, where a child group can be made (root), or None."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
                if (folder / "memory.limit_in_bytes").exists() and os.access(folder, os.W_OK):
                    return folder
    return None


@contextlib.contextmanager
def _capped(pid: int, limit: int) -> Iterator[Path]:
    """`pid` moved into a memory cgroup of its own whose new charges may not pass `limit`."""
    parent = _memory_cgroup()
    assert parent is not None
    group = parent / f"remedy-oom-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        deadline = time.monotonic() + 60
        while True:  # removable once the killed process has left it
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def _wait(what: str, ready: Any, proc: subprocess.Popen[str]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (found := ready()):
        assert proc.poll() is None, f"remedy run ended before {what}: {proc.stderr}"
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s"
        time.sleep(0.5)
    return found


def _died(run_dir: Path, incarnation: int) -> dict[str, Any] | None:
    history = read_journal(run_dir / "history.jsonl")
    found = [r for r in history if r.get("type") == "supervisor_died"]
    return next((r for r in found if r.get("incarnation") == incarnation), None)


def test_the_history_says_how_each_supervisor_died(tmp_path: Path) -> None:
    """kill -9: cause `signal`; the OOM killer (where a memory cgroup can be made): `oom_killer`
    with the kernel's line; explain lists both; the logs are kept with the dead ones' files."""
    run_dir, home = tmp_path / "run", tmp_path / "home"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "REMEDY_HOME": str(home)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "remedy.cli", "run", TINY, "--address", "local",
         "--run-dir", str(run_dir), "--quiet", "--", "--steps", "100000", "--sleep", "0.05"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    oom = _memory_cgroup() is not None
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait("training", lambda: metrics.exists() and metrics.stat().st_size > 2000, proc)
        first = claimed_supervisors(run_dir)[1]
        assert first is not None
        os.kill(first, signal.SIGKILL)  # kill -9
        died = _wait("supervisor_died of the first", lambda: _died(run_dir, 1), proc)
        assert died["pid"] == first and died["exit_type"] == "SYSTEM_ERROR", died
        assert died["cause"] in ("signal", "signal_or_oom"), died
        if oom:
            assert died["cause"] == "signal", died  # the kernel log names no OOM kill of it
            second = _wait("a second supervisor", lambda: claimed_supervisors(run_dir).get(2), proc)
            [entry_file] = (home / "runs").glob("*.json")
            entry = json.loads(entry_file.read_text())
            call_env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": entry["ray_token"]}
            with _capped(second, 64 << 20):
                subprocess.run(
                    [sys.executable, "-c", BIG_CALL, entry["address"], entry["run_id"]],
                    env=call_env, capture_output=True, text=True, timeout=240, check=False,
                )  # fmt: skip
                died = _wait("supervisor_died of the second", lambda: _died(run_dir, 2), proc)
            assert died["pid"] == second and died["cause"] == "oom_killer", died
            assert f"Killed process {second} (" in died["reason"], died
    finally:
        proc.send_signal(signal.SIGTERM)  # the run stops cleanly, as on Ctrl-C
        try:
            proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=60)
    text = explain(load_run(run_dir))
    print(text)
    assert f"supervisor 1 (pid {first}) died: pid {first} ended without exiting" in text, text
    if oom:
        assert "supervisor 2 (pid " in text and "killed by the kernel's OOM killer" in text, text
    index = json.loads((run_dir / "logs" / "index.json").read_text())["files"]
    dead = {r["pid"] for r in read_journal(run_dir / "history.jsonl")
            if r.get("type") == "supervisor_died"}  # fmt: skip
    kept = {f["pid"] for f in index if f["role"] == "supervisor" and f["kept"]}
    assert dead <= kept, (dead, index)
