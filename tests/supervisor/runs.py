"""Helpers for tests that need a real run directory: the tiny `display_train.py` job, supervised or alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import NAMESPACE, RunSpec
from remedy.supervisor.agent.actor import agent_name, alive_nodes
from tests.paths import PYTHONPATH

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
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
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


def agent_steps_seen(run_dir: Path, rank: int | None = None) -> int:
    """The highest step a rank (`rank`, else any) has reported to its agent so far, from the
    agents' metrics files (-1: none yet)."""
    steps = [
        int(json.loads(line).get("step", 0))
        for path in run_dir.glob("metrics-agent-*.jsonl")
        for line in path.read_text().splitlines()
        if line.strip().endswith("}") and (rank is None or f'"rank": {rank}' in line)
    ]
    return max(steps, default=-1)


def agent_once_at(spec: RunSpec, step: int, timeout_s: float, rank: int | None = None) -> Any:
    """This one-node cluster's agent of run `spec`, once a rank reported `step` to it (or
    `timeout_s` passed)."""
    run_dir = Path(spec.run_dir)
    deadline = time.monotonic() + timeout_s
    while agent_steps_seen(run_dir, rank) < step and time.monotonic() < deadline:
        time.sleep(0.05)
    (node,) = alive_nodes()
    return ray.get_actor(agent_name(spec.run_id, node), NAMESPACE)
