"""The private Ray of `remedy run` killed from outside (its raylet or its GCS): one line says
the cluster went away, and the run directory gets a summary with status `failed`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import PYTHONPATH

REPO = Path(__file__).resolve().parents[2]
TINY = f"{REPO / 'tests' / 'robustness' / 'targets' / 'tiny.py'}:main"

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]


def _children(pid: int) -> dict[int, str]:
    """Direct children of `pid` (pid -> name), from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        head, _, rest = text.rpartition(")")
        if int(rest.split()[1]) == pid:
            out[int(entry)] = head.partition("(")[2]
    return out


@pytest.mark.parametrize("daemon", ["raylet", "gcs_server"])
def test_private_ray_killed_under_a_run(daemon: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": PYTHONPATH,
        "REMEDY_HOME": str(tmp_path / "home"),
    }
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "remedy.cli", "run", TINY, "--address", "local",
         "--run-dir", str(run_dir), "--quiet", "--", "--steps", "100000", "--sleep", "0.02"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        metrics = run_dir / "metrics.jsonl"
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 20:
            assert proc.poll() is None and time.monotonic() < deadline, "the run never trained"
            time.sleep(0.5)
        victims = [pid for pid, name in _children(proc.pid).items() if name == daemon]
        assert len(victims) == 1, _children(proc.pid)
        os.kill(victims[0], 9)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err
    said = [line for line in err.splitlines() if line.startswith("remedy:")]
    assert len(said) == 1 and "went away under it" in said[0], err
    assert "Traceback" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
