"""The clean-run corpus: every example loop trains 1000+ steps with no anomaly and no decision."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.clean_runs import JOBS, run_job

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("job", list(JOBS))
def test_clean_run_raises_nothing(job: str, tmp_path: Path) -> None:
    """One seed of each job of benchmarks/clean_runs.py, full length, every default detector and
    the default policy, alone as a user runs it: 0 anomaly events, 0 decisions, 1000+ steps."""
    row = run_job(job, seed=0, run_dir=tmp_path)
    assert row.steps >= 1000
    assert (row.events, row.decisions) == (0, 0), dict(row.kinds)
