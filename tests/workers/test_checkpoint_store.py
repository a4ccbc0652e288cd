"""Durable checkpoints: directory fsync, bounded write retries, known-good retention, retirement, commits."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from remedy.rank.exceptions import CheckpointError
from remedy.rank.state import checkpoint_store
from remedy.rank.state.checkpoint_store import CheckpointStore, checkpoint_tick, committed_steps
from remedy.rank.state.snapshots import Snapshot, capture_rng


def snap(step: int, value: float = 0.0) -> Snapshot:
    return Snapshot(
        step=step,
        tick=step + 1000,
        cursor=step,
        model={"w": torch.full((4,), value)},
        optimizer={"state": {}, "param_groups": []},
        scheduler=None,
        scaler=None,
        rng=capture_rng(),
    )


@pytest.fixture(autouse=True)
def _no_retry_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries do not sleep in tests."""
    monkeypatch.setattr(checkpoint_store, "WRITE_WAIT_S", (0.0, 0.0))


def test_write_fsyncs_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the renames the checkpoint directory itself is fsynced, so the new names survive a crash."""
    dirs: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            dirs.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store = CheckpointStore(tmp_path)
    store.save_now(snap(10))
    assert dirs, "no directory was fsynced"
    store.close()


def test_transient_write_error_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError on the first two writes is retried; the checkpoint lands and loads back."""
    real = os.replace
    calls = {"n": 0}

    def flaky(src: Any, dst: Any) -> None:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    store = CheckpointStore(tmp_path)
    store.save_now(snap(10, 2.0))
    monkeypatch.setattr(os, "replace", real)
    assert store.steps() == [10]
    assert torch.equal(store.load(10).model["w"], torch.full((4,), 2.0))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    store.close()


def test_persistent_write_error_raises_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that keeps failing gives CheckpointError after the bounded attempts; nothing half-written is listed."""
    calls = {"n": 0}

    def broken(src: Any, dst: Any) -> None:
        calls["n"] += 1
        raise OSError(5, "Input/output error")

    store = CheckpointStore(tmp_path)
    store.save_now(snap(10))
    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(CheckpointError, match="could not be written after 4 attempts"):
        store.save_now(snap(20))
    assert calls["n"] == checkpoint_store.WRITE_ATTEMPTS
    assert store.steps() == [10]
    store.close()


def test_retention_never_deletes_the_known_good(tmp_path: Path) -> None:
    """The last checkpoint verified by a restore outlives `keep` newer unverified ones."""
    store = CheckpointStore(tmp_path, keep=2, verify_writes=False)
    store.save_now(snap(0, 1.0))
    store.load(0)  # a successful restore verifies it
    for s in (10, 20, 30):
        store.save_now(snap(s))
    assert store.steps() == [0, 20, 30]
    assert CheckpointStore(tmp_path, keep=2).known_good == 0  # kept on disk for a fresh process
    store.close()


def test_read_back_verifies_and_marks_known_good(tmp_path: Path) -> None:
    """With read-back verification every completed write becomes the known-good one."""
    store = CheckpointStore(tmp_path, keep=2)
    for s in (10, 20, 30):
        store.save_now(snap(s))
    assert store.known_good == 30 and store.steps() == [20, 30]
    store.close()


def test_retire_after_drops_the_abandoned_timeline(tmp_path: Path) -> None:
    """retire_after(S) removes every checkpoint newer than S, and steps() no longer lists them."""
    store = CheckpointStore(tmp_path, keep=5)
    for s in (10, 20, 30, 40):
        store.save_now(snap(s))
    assert store.retire_after(20) == [30, 40]
    assert store.steps() == [10, 20]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-00000010.rank0.json",
        "step-00000010.rank0.pt",
        "step-00000020.rank0.json",
        "step-00000020.rank0.pt",
    ]
    assert store.known_good is None  # step 40 was abandoned with its timeline
    assert committed_steps(tmp_path, 1) == [10, 20]
    store.close()


def test_committed_steps_are_those_every_rank_holds(tmp_path: Path) -> None:
    """A step counts only when every rank has its manifest and a payload of the recorded size."""
    stores = [CheckpointStore(tmp_path, rank=r, keep=5) for r in range(3)]
    for s in (10, 20, 30):
        for store in stores:
            if not (s == 30 and store.rank == 2):
                store.save_now(snap(s))
    assert committed_steps(tmp_path, 3) == [10, 20]
    # A truncated payload is not committed.
    payload = tmp_path / "step-00000020.rank1.pt"
    payload.write_bytes(payload.read_bytes()[:-3])
    assert committed_steps(tmp_path, 3) == [10]
    assert committed_steps(tmp_path, 2) == [10, 30]
    assert committed_steps(tmp_path / "none", 2) == []
    assert checkpoint_tick(tmp_path, 10) == 1010
    for store in stores:
        store.close()


def test_verified_steps_reports_each_corrupt_one(tmp_path: Path) -> None:
    """verified_steps lists the good steps and tells on_corrupt of the ones failing checksums."""
    store = CheckpointStore(tmp_path, keep=5)
    for s in (10, 20, 30):
        store.save_now(snap(s))
    path = tmp_path / "step-00000020.rank0.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    seen: list[int] = []
    store.on_corrupt = lambda step, err: seen.append(step)
    assert store.verified_steps(at_or_before=25) == [10]
    assert seen == [20]
    store.close()
