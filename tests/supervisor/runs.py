"""Helpers for tests that need a real run directory: the tiny `display_train.py` job, supervised or alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray

from remedy.supervisor.runner import run_supervised
from remedy.supervisor.spec import RunSpec

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TRAIN = HERE / "display_train.py"
TARGET = f"{TRAIN}:main"


def supervised(
    run_dir: Path,
    *,
    faults: list[dict[str, Any]] | None = None,
    argv: list[str] | None = None,
    policy: str = "default",
) -> dict[str, Any]:
    """Run the tiny job under a real supervisor on the session's Ray; return the summary."""
    spec = RunSpec(
        target=TARGET,
        policy=policy,
        run_dir=str(run_dir),
        faults=faults or [],
        argv=argv or [],
        threads_per_rank=1,
    )
    return run_supervised(spec)


def standalone(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the tiny job alone in a fresh process (a Guard with `run_dir=`, no supervisor)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(TRAIN), "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=env,
    )


def finished(supervisor: Any, timeout_s: float = 240.0) -> dict[str, Any]:
    """The summary of a started supervisor's run, waiting for it as drivers do (`wait` in a loop)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        summary = ray.get(supervisor.wait.remote(1.0))
        if summary is not None:
            return dict(summary)
    raise TimeoutError(f"the run did not end within {timeout_s:g}s")
