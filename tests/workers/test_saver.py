"""The rank's snapshots and checkpoints as their own part (workers.saver), on a real store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from remedy.rank.state.checkpoint_store import CheckpointStore
from remedy.rank.state.saver import Saver
from remedy.rank.state.snapshots import Snapshot

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]


def _taker(weights: torch.Tensor) -> Any:
    """`take` for `Saver.save`: the state is one tensor, copied into `into`'s buffers if given."""

    taken = 0

    def take(into: Snapshot | None) -> Snapshot:
        nonlocal taken
        taken += 1
        if into is not None:
            into.model["w"].copy_(weights)
            into.step = into.tick = into.cursor = taken
            return into
        return Snapshot(taken, taken, taken, {"w": weights.clone()}, {}, None, None, {})

    return take


def test_a_checkpoint_is_written_when_due_with_its_extra_and_read_back(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    saver = Saver(3, store, None, rank=0)
    w = torch.arange(4.0)
    take = _taker(w)
    saver.save(1, take)  # not due: ring only
    saver.save(2, take, extra=lambda: {"micro_batches": 2})
    saver.close()
    assert saver.snapshots.steps() == [1, 2]
    assert store.steps() == [2]
    back = store.load(2)
    assert back.extra == {"micro_batches": 2} and torch.equal(back.model["w"], w)
    assert saver.write_failures() == [] and saver.corrupt() == []


def test_a_failed_write_is_kept_once_for_the_boundary_and_training_goes_on(tmp_path: Path) -> None:
    """Chaos `write_fault`: the write meets a file-size limit of 0; the failure is handed over
    once, the snapshot stays in the ring, and a later write succeeds."""
    store = CheckpointStore(tmp_path, rank=0)
    saver = Saver(3, store, None, rank=0)
    take = _taker(torch.ones(1000))
    saver.save(1, take, extra=dict, write_fault=True)
    store.wait()
    [(step, error)] = saver.write_failures()
    assert step == 1 and error
    assert saver.write_failures() == []
    saver.save(2, take, extra=dict)
    saver.close()
    assert store.steps() == [2] and saver.snapshots.steps() == [1, 2]


def test_a_corrupt_checkpoint_met_while_restoring_is_handed_over(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, rank=0)
    saver = Saver(2, store, None, rank=0)
    saver.save(1, _taker(torch.ones(3)), extra=dict)
    store.wait()
    payload = next(tmp_path.glob("step-00000001.rank0.pt"))
    payload.write_bytes(payload.read_bytes()[:-8] + b"corrupt!")
    assert store.verified_steps() == []
    [(step, error)] = saver.corrupt()
    assert step == 1 and "checksum" in error.lower()
    assert saver.corrupt() == []
    saver.close()


def test_a_full_ring_recycles_its_oldest_buffers_and_start_over_keeps_one() -> None:
    saver = Saver(2, None, None, rank=0)
    take = _taker(torch.zeros(2))
    first = saver.save(1, take)
    saver.save(2, take)
    third = saver.save(3, take)  # the full ring hands over step 1's snapshot
    assert third is first and saver.snapshots.steps() == [2, 3]
    saver.start_over(third)
    assert saver.snapshots.steps() == [3] and saver.snapshots.capacity == 2
    saver.close()
