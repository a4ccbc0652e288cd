"""The supervisor SIGKILLed at random moments of a run with a NaN and a hang: every run completes
with the weights of the run without a kill (benchmarks/random_kills.py, with fewer kills)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.random_kills import kill_times, one_run, table

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.timeout(900)
@pytest.mark.usefixtures("ray_cluster")
def test_random_supervisor_kills_end_with_the_twins_weights(tmp_path: Path) -> None:
    """Three kills at seeded random moments 1-40 s into training: each lands, Ray restarts the
    supervisor, the run completes, no decision id is given twice, and every rank's final
    parameters are the twin's bit for bit."""
    twin = one_run(tmp_path / "twin", None)
    assert twin.status == "completed" and twin.restarts == 0, twin
    assert len(twin.digests) == 1, twin
    # Counted from rank 0's first step: each kill falls in training, however slow the start.
    runs = [
        one_run(tmp_path / f"kill{i}", at_s, clock="training")
        for i, at_s in enumerate(kill_times(3, seed=7, window=(1.0, 40.0)))
    ]
    report = "\n".join(table(twin, runs))
    for run in runs:
        assert run.killed and run.restarts >= 1, report
        assert run.status == "completed" and run.ids_unique, report
        assert run.same_weights(twin), report
