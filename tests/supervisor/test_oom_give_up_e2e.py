"""Under the supervisor, an OOM nothing relieves ends the run aborted with the rank's reason, goodput 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec

pytestmark = [pytest.mark.ray]

TARGET = f"{Path(__file__).resolve().parent / 'oom_train.py'}:main"


@pytest.mark.timeout(180)
def test_an_unrelievable_oom_aborts_a_supervised_run(ray_cluster: None, tmp_path: Path) -> None:
    """Every step out of memory: the rank stops itself at step 3, the run is `aborted`, not `failed`."""
    spec = RunSpec(target=TARGET, workers=1, run_dir=str(tmp_path / "run"), threads_per_rank=1)
    summary = run_supervised(spec)
    assert summary["status"] == "aborted", summary
    assert "ran out of memory" in str(summary["abort_reason"]), summary["abort_reason"]
    assert summary["steps_completed"] == 3
    assert summary["goodput"] == 0.0, "no update was applied"
    assert summary["updates_skipped"] == 3
