"""The clean-run corpus: every example loop trains 1000+ steps with no anomaly and no decision."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.clean_runs import GROUP_JOBS, JOBS, run_group_job, run_job

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.timeout(120)
# hf_gpt2 (about 30 s, most of it loading transformers) runs in the slow tier.
@pytest.mark.parametrize(
    "job", [pytest.param(j, marks=pytest.mark.slow) if j == "hf_gpt2" else j for j in JOBS]
)
def test_clean_run_raises_nothing(job: str, tmp_path: Path) -> None:
    """One seed of each job of benchmarks/clean_runs.py, full length, every default detector and
    the default policy, alone as a user runs it: 0 anomaly events, 0 decisions, 1000+ steps."""
    row = run_job(job, seed=0, run_dir=tmp_path)
    assert row.steps >= 1000
    assert (row.events, row.decisions) == (0, 0), dict(row.kinds)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", list(GROUP_JOBS))
def test_clean_group_run_raises_nothing(job: str, ray_cluster: None, tmp_path: Path) -> None:
    """One seed of each group job (nanoGPT on 2 ranks, rank 0 evaluating alone while rank 1
    waits for it) under a supervisor: 0 anomaly events, 0 decisions, every step."""
    row = run_group_job(job, seed=0, run_dir=tmp_path)
    assert row.steps >= 500
    assert (row.events, row.decisions) == (0, 0), dict(row.kinds)
    assert row.waited_s is not None and row.waited_s > 0.5  # rank 1 did wait for the evals
