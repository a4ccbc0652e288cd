"""Process faults fire once per run (a marker in the run directory), not once per process."""

from __future__ import annotations

from pathlib import Path

from remedy.workers.chaos import parse_chaos
from remedy.workers.context import WorkerContext, set_context
from remedy.workers.process_faults import first_time_in_run, slow


def test_a_fault_fires_once_per_run_across_processes(tmp_path: Path) -> None:
    """A second process of the same run (a replacement) finds the marker and does not fire."""
    set_context(WorkerContext(rank=3, run_dir=tmp_path))
    assert first_time_in_run("kill_rank", 3, 20)
    assert not first_time_in_run("kill_rank", 3, 20)  # what a replacement replaying step 20 sees
    assert first_time_in_run("kill_rank", 3, 21)
    assert (tmp_path / "chaos" / "kill_rank-rank3-step20").is_file()


def test_without_a_run_directory_every_call_fires() -> None:
    """No run directory, no marker: the caller's own once-per-process rule is all there is."""
    set_context(None)
    assert first_time_in_run("hang_rank", 0, 1)
    assert first_time_in_run("hang_rank", 0, 1)


def test_slow_collective_sleeps_once(tmp_path: Path) -> None:
    """slow_collective delays the rank once per run."""
    set_context(WorkerContext(rank=0, run_dir=tmp_path))
    assert slow(0, 5, 0.0)
    assert not slow(0, 5, 0.0)


def test_chaos_files_accept_the_multi_rank_faults() -> None:
    """hang_rank, kill_rank and slow_collective are injectable."""
    faults = parse_chaos({"faults": [
        {"kind": "hang_rank", "at_step": 3, "rank": 1},
        {"kind": "kill_rank", "at_step": 4, "rank": 2},
        {"kind": "slow_collective", "at_step": 5, "rank": 0, "seconds": 2.0},
    ]})  # fmt: skip
    assert [f.kind for f in faults] == ["hang_rank", "kill_rank", "slow_collective"]
