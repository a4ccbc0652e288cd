"""Runs on one machine are isolated: each `remedy run` has its own private Ray, which nothing else joins."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remedy.cli.cluster import probe
from remedy.protocol.exceptions import ClusterError
from tests.paths import PYTHONPATH

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TINY = f"{REPO / 'tests' / 'robustness' / 'targets' / 'tiny.py'}:main"
V2 = "version: 1\nname: v2\nrules:\n  - name: nan\n    when: {anomaly: nonfinite_loss}\n    do: [notify]\n"


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PYTHONPATH=PYTHONPATH,
        HOME=str(home),
        REMEDY_HOME=str(home / ".remedy"),
    )
    return env


def _remedy(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remedy.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env=_env(home),
    )


def _start(home: Path, run_dir: Path, *, steps: int) -> subprocess.Popen[str]:
    argv = ["run", TINY, "--run-dir", str(run_dir), "--quiet", "--", "--steps", str(steps)]
    return subprocess.Popen(
        [sys.executable, "-m", "remedy.cli", *argv, "--sleep", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(home),
    )


def _registry(home: Path, timeout_s: float = 120) -> dict[str, object]:
    """The registry entry of the one live run, once the run has registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in (home / ".remedy" / "runs").glob("*.json"):
            try:
                return dict(json.loads(path.read_text()))
            except ValueError:
                pass  # being written
        time.sleep(0.2)
    raise AssertionError("the first run never registered")


def test_two_concurrent_runs_both_complete(tmp_path: Path) -> None:
    """Two `remedy run`s started seconds apart both complete, each with its own summary.json."""
    home = tmp_path / "home"
    home.mkdir()
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first = _start(home, first_dir, steps=400)
    second = None
    try:
        entry = _registry(home)
        # Started while the first trains, and still training when the first ends and stops its
        # Ray: a second run that had joined that Ray would die with it.
        second = _start(home, second_dir, steps=500)
        address = str(entry["address"])
        # Nothing that looks for a cluster finds it: remedy's `auto` reads only what `ray start`
        # wrote, and a process that finds it anyway is refused without the run's token.
        with pytest.raises(ClusterError, match="authentication token"):
            probe(address)
        auto = _remedy(home, "run", TINY, "--address", "auto")
        assert auto.returncode == 2 and "no running Ray cluster found" in auto.stderr
        joined = _remedy(home, "run", TINY, "--address", address)
        assert joined.returncode == 2
        assert "authentication token" in joined.stderr
        deadline = time.monotonic() + 120
        while not (first_dir / "metrics.jsonl").exists():
            assert time.monotonic() < deadline, "the first run never trained"
            time.sleep(0.2)
        # `remedy status` reaches the private run through its registry entry.
        status = _remedy(home, "status", str(entry["run_id"]))
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout.splitlines()[0])["run_id"] == entry["run_id"]
        # So does `remedy policy apply`.
        policy = tmp_path / "v2.yaml"
        policy.write_text(V2)
        applied = _remedy(home, "policy", "apply", str(policy), "--run", str(entry["run_id"]))
        assert applied.returncode == 0, applied.stderr
        out, err = first.communicate(timeout=180)
        out2, err2 = second.communicate(timeout=180)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert first.returncode == 0, err
    assert second.returncode == 0, err2
    # --quiet prints JSON lines; the last is the run's summary.
    for stdout, run_dir in ((out, first_dir), (out2, second_dir)):
        last = json.loads(stdout.strip().splitlines()[-1])
        assert (last["event"], last["status"]) == ("summary", "completed")
        assert str(run_dir) in stdout, "the report event names the run directory"
    for run_dir, steps in ((first_dir, 400), (second_dir, 500)):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed"
        assert summary["steps_completed"] == steps
    assert "Traceback" not in err + err2
    # A finished run's entry stays (for `remedy status RUN_ID`), says how it ended, and no longer
    # holds its private Ray's token.
    entries = [json.loads(p.read_text()) for p in (home / ".remedy" / "runs").glob("*.json")]
    assert sorted(e["state"] for e in entries) == ["completed", "completed"]
    assert all(e["ray_token"] is None and len(e["token"]) == 32 for e in entries)
    history = (first_dir / "history.jsonl").read_text()
    assert '"policy_reloaded"' in history and '"to": "v2"' in history


def test_terminated_run_stops_its_private_ray(tmp_path: Path) -> None:
    """SIGTERM to `remedy run` ends it like Ctrl-C: the run is stopped cleanly (summary.json says
    `stopped`), exit 1, its private Ray gone."""
    home = tmp_path / "home"
    home.mkdir()
    run = _start(home, tmp_path / "run", steps=5000)
    try:
        entry = _registry(home)
        temp_dir = Path(str(entry["temp_dir"]))
        assert temp_dir.is_dir()
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "metrics.jsonl").exists():
            assert time.monotonic() < deadline, "the run never trained"
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1
    assert "remedy: interrupted" in err and "Traceback" not in err
    assert not temp_dir.exists(), "the private Ray's directory is removed"
    (path,) = (home / ".remedy" / "runs").glob("*.json")
    assert json.loads(path.read_text())["state"] == "stopped"
    assert (tmp_path / "run" / "metrics.jsonl").exists(), "the run's own files are kept"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "stopped" and "interrupted" in summary["stop_reason"]
    assert summary["steps_completed"] < 5000
    assert f"run {entry['run_id']} stopped; summary in" in err
    with pytest.raises(ClusterError):
        probe(str(entry["address"]))
