"""Snapshots restore exactly; the ring keeps the newest; checkpoints are atomic and verified."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from remedy.rank.exceptions import CheckpointError
from remedy.rank.state.checkpoint_store import CheckpointStore
from remedy.rank.state.snapshots import (
    Snapshot,
    SnapshotRing,
    capture_rng,
    clone_to_host,
    restore_rng,
)


def snap(step: int, value: float = 0.0) -> Snapshot:
    return Snapshot(
        step=step,
        tick=step,
        cursor=step,
        model={"w": torch.full((4,), value)},
        optimizer={"state": {}, "param_groups": []},
        scheduler=None,
        scaler=None,
        rng=capture_rng(),
    )


def test_clone_to_host_is_deep() -> None:
    """Mutating the source after cloning leaves the clone untouched."""
    src = {"a": torch.ones(3), "b": [torch.zeros(2), {"c": torch.ones(1)}]}
    copy = clone_to_host(src)
    src["a"].add_(1)
    src["b"][1]["c"].add_(5)
    assert torch.equal(copy["a"], torch.ones(3))
    assert torch.equal(copy["b"][1]["c"], torch.ones(1))


def test_rng_roundtrip() -> None:
    """Restoring the RNG state replays the same random draws."""
    state = capture_rng()
    a = torch.rand(5)
    restore_rng(state)
    assert torch.equal(a, torch.rand(5))


def test_ring_keeps_newest_and_finds_at_or_before() -> None:
    """The ring drops the oldest and answers 'newest at or before step'."""
    ring = SnapshotRing(3)
    for s in (0, 10, 20, 30):
        ring.push(snap(s))
    assert ring.steps() == [10, 20, 30]
    found = ring.newest_at_or_before(25)
    assert found is not None and found.step == 20
    assert ring.newest_at_or_before(5) is None


def test_ring_drops_abandoned_timeline() -> None:
    """After a rollback, pushing an earlier step discards the snapshots after it."""
    ring = SnapshotRing(5)
    for s in (0, 10, 20, 30):
        ring.push(snap(s))
    ring.push(snap(10, value=1.0))
    assert ring.steps() == [0, 10]


def test_checkpoint_roundtrip(tmp_path: Path) -> None:
    """A saved checkpoint loads back equal, with its manifest checksum verified."""
    store = CheckpointStore(tmp_path, rank=0)
    store.save(snap(100, 3.0)).result()
    loaded = store.load_latest()
    assert loaded.step == 100 and torch.equal(loaded.model["w"], torch.full((4,), 3.0))
    store.close()


def test_corrupt_checkpoint_falls_back_to_previous(tmp_path: Path) -> None:
    """A checkpoint whose bytes changed fails its checksum and the previous one is used."""
    store = CheckpointStore(tmp_path, rank=0)
    store.save_now(snap(100, 1.0))
    path = store.save_now(snap(200, 2.0))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    seen: list[int] = []
    store.on_corrupt = lambda step, err: seen.append(step)
    loaded = store.load_latest()
    assert loaded.step == 100 and seen == [200]
    with pytest.raises(CheckpointError, match="checksum"):
        store.load(200)
    store.close()


def test_no_usable_checkpoint_raises(tmp_path: Path) -> None:
    """With nothing usable on disk, load_latest raises CheckpointError saying so."""
    store = CheckpointStore(tmp_path, rank=0)
    with pytest.raises(CheckpointError, match="none written yet"):
        store.load_latest()
    store.close()


def test_store_keeps_newest(tmp_path: Path) -> None:
    """Only the newest `keep` checkpoints stay on disk."""
    store = CheckpointStore(tmp_path, rank=0, keep=2)
    for s in (10, 20, 30):
        store.save_now(snap(s))
    assert store.steps() == [20, 30]
    assert len(list(tmp_path.glob("*.pt"))) == 2
    store.close()


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    """Completed writes leave only payloads, manifests and the known-good marker behind."""
    store = CheckpointStore(tmp_path, rank=1)
    store.save_now(snap(5))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "known-good.rank1.json",
        "step-00000005.rank1.json",
        "step-00000005.rank1.pt",
    ]
    store.close()


def test_clone_into_reuses_matching_buffers() -> None:
    """Cloning into an old tree overwrites matching host tensors in place and allocates the rest."""
    old = {"a": torch.zeros(3), "b": [torch.zeros(2)], "c": torch.zeros(4)}
    src = {"a": torch.ones(3), "b": [torch.full((2,), 2.0)], "c": torch.ones(5)}
    out = clone_to_host(src, into=old)
    assert out["a"].data_ptr() == old["a"].data_ptr() and torch.equal(out["a"], torch.ones(3))
    assert out["b"][0].data_ptr() == old["b"][0].data_ptr()
    assert out["c"].data_ptr() != old["c"].data_ptr() and out["c"].shape == (5,)
    src["a"].add_(1)
    assert torch.equal(out["a"], torch.ones(3))


def test_ring_names_the_snapshot_it_will_evict() -> None:
    """recyclable() is the oldest of a full ring, and None when a push would not evict it."""
    ring = SnapshotRing(2)
    ring.push(snap(0))
    assert ring.recyclable(10) is None
    ring.push(snap(10))
    oldest = ring.recyclable(20)
    assert oldest is not None and oldest.step == 0
    assert ring.recyclable(10) is None  # a rollback push pops instead of evicting
