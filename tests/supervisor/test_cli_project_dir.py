"""`remedy run` from a user's project whose folders are named like remedy's own packages."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import PYTHONPATH

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "robustness" / "targets" / "tiny.py"
POLICY = "version: 1\nname: mine\nrules:\n  - name: nan\n    when: {anomaly: nonfinite_loss}\n    do: [notify]\n"


@pytest.mark.parametrize("target", ["train.py:main", "train:main"])
def test_run_from_a_project_with_policies_workers_supervisor_folders(
    tmp_path: Path, target: str
) -> None:
    """A project holding policies/, workers/, supervisor/ packages and a workers.py runs its own
    target (as a file or as a module) with its own policy; none of its folders is imported."""
    project = tmp_path / "project"
    for name in ("policies", "workers", "supervisor"):
        (project / name).mkdir(parents=True)
        # Importing any of them instead of remedy's would fail loudly.
        (project / name / "__init__.py").write_text(f"raise ImportError('user {name} imported')\n")
    (project / "workers.py").write_text("raise ImportError('user workers.py imported')\n")
    (project / "policies" / "mine.yaml").write_text(POLICY)
    shutil.copy(TINY, project / "train.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PYTHONPATH=PYTHONPATH,
        HOME=str(tmp_path),
        REMEDY_HOME=str(tmp_path / ".remedy"),
    )
    argv = ["run", target, "--policy", "policies/mine.yaml", "--run-dir", "out", "--quiet"]
    proc = subprocess.run(
        [sys.executable, "-m", "remedy.cli", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
        cwd=project,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((project / "out" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 20
    assert summary["policy"] == str(project / "policies" / "mine.yaml")
    assert "imported" not in proc.stderr
