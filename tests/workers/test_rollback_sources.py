"""The rollback's `source` and `older`: the escalation ladder's durable and older-checkpoint rungs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.workers.test_actions import command, guarded, last_outcome, train

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]


def test_source_disk_skips_the_snapshot_ring(tmp_path: Path) -> None:
    """`source: disk` restores the newest durable checkpoint at or before the target, even
    when the in-memory ring holds that step."""
    guard, it = guarded(60, tmp_path, checkpoint_every=10)
    train(guard, it, 35)
    assert 25 in guard.snapshots.steps()
    guard.submit(command("rollback", anomaly_step=35, steps_back=10, source="disk"))
    next(it)
    outcome = last_outcome(guard)
    assert outcome.outcome == "applied", outcome.detail
    assert (outcome.result["restored_step"], outcome.result["source"]) == (20, "disk")
    guard.close()


def test_older_passes_over_the_newest_good_checkpoints(tmp_path: Path) -> None:
    """`older: 1` restores the good checkpoint before the newest one at or before the target."""
    guard, it = guarded(60, tmp_path, checkpoint_every=10)
    train(guard, it, 35)
    guard.submit(command("rollback", anomaly_step=35, steps_back=10, source="disk", older=1))
    next(it)
    outcome = last_outcome(guard)
    assert outcome.outcome == "applied", outcome.detail
    assert (outcome.result["restored_step"], outcome.result["source"]) == (10, "disk")
    assert "passed over the 1 newest good one" in outcome.detail
    guard.close()


def test_source_disk_without_a_store_fails_with_the_reason() -> None:
    """No run directory, no durable checkpoint: the rung fails, saying why (the ladder climbs)."""
    guard, it = guarded(30)
    train(guard, it, 12)
    guard.submit(command("rollback", anomaly_step=12, steps_back=5, source="disk"))
    next(it)
    outcome = last_outcome(guard)
    assert outcome.outcome == "failed"
    assert "needs remedy's checkpoint store" in outcome.detail
    assert guard.step_count == 12
    guard.close()


def test_older_than_every_checkpoint_fails(tmp_path: Path) -> None:
    """Asking to pass over more good checkpoints than exist fails, naming how many were needed."""
    guard, it = guarded(60, tmp_path, checkpoint_every=10)
    train(guard, it, 25)
    guard.submit(command("rollback", anomaly_step=25, steps_back=5, source="disk", older=5))
    next(it)
    outcome = last_outcome(guard)
    assert outcome.outcome == "failed"
    assert "no 6 good durable checkpoints at or before step 20" in outcome.detail
    guard.close()


def test_source_memory_never_reads_the_disk(tmp_path: Path) -> None:
    """`source: memory` with a ring too short restores the newest snapshot before the anomaly."""
    guard, it = guarded(60, tmp_path, snapshot_ring=2, checkpoint_every=10)
    train(guard, it, 35)
    guard.submit(command("rollback", anomaly_step=35, steps_back=15, source="memory"))
    next(it)
    outcome = last_outcome(guard)
    assert outcome.outcome == "applied", outcome.detail
    assert outcome.result["source"] == "memory"
    guard.close()
