"""A Ray Train rank tells a restart of its run from the run directory (Ray Train says nothing)."""

from __future__ import annotations

import json
from pathlib import Path

from remedy.rank.link import relaunch
from remedy.rank.link.context import WorkerContext


def _start(run_dir: Path, rank: int, launcher: str = "Ray Train") -> WorkerContext:
    ctx = WorkerContext(rank=rank, world_size=2, run_dir=run_dir, launcher=launcher)
    relaunch.note_start(ctx)
    return ctx


def test_a_first_start_is_attempt_zero(tmp_path: Path) -> None:
    """A fresh run directory: attempt 0, the plain run id, and each rank's start noted."""
    ctxs = [_start(tmp_path / "run", r) for r in (0, 1)]
    assert [(c.attempt, c.run_id) for c in ctxs] == [(0, "local"), (0, "local")]
    assert relaunch.noted_attempt(tmp_path / "run", 1) == 0


def test_a_start_again_of_an_unfinished_run_is_the_next_attempt(tmp_path: Path) -> None:
    """No summary, or a `failed` one (a lost peer): the next attempt, with ids of its own."""
    run = tmp_path / "run"
    for r in (0, 1):
        _start(run, r)
    assert [_start(run, r).run_id for r in (0, 1)] == ["local-restart1"] * 2
    (run / "summary.json").write_text(json.dumps({"status": "failed"}))
    again = [_start(run, r) for r in (0, 1)]
    assert [(c.attempt, c.run_id) for c in again] == [(2, "local-restart2")] * 2


def test_a_finished_run_starts_afresh(tmp_path: Path) -> None:
    """A run that completed (or aborted) in this directory is not resumed: attempt 0."""
    run = tmp_path / "run"
    _start(run, 0)
    (run / "summary.json").write_text(json.dumps({"status": "completed"}))
    assert _start(run, 0).attempt == 0


def test_torchrun_and_no_run_dir_are_left_alone(tmp_path: Path) -> None:
    """torchrun says which attempt it is itself; without a run directory nothing is noted."""
    _start(tmp_path, 0, launcher="torchrun")
    assert not relaunch.marker(tmp_path, 0).exists()
    ctx = WorkerContext(rank=0, world_size=2, launcher="Ray Train")
    relaunch.note_start(ctx)
    assert ctx.attempt == 0


def test_an_unreadable_note_is_a_first_start(tmp_path: Path) -> None:
    """A note that is not this format is no evidence of a start: attempt 0."""
    relaunch.marker(tmp_path, 0).write_text("not json")
    assert _start(tmp_path, 0).attempt == 0
