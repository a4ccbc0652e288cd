"""Snapshots of everything a rollback must restore, and the in-memory ring.

A snapshot is taken at a step boundary (after step `step - 1` finished,
before step `step` starts) and holds host copies of the model, optimizer,
LR scheduler and GradScaler state, every RNG the loop draws from, the
data position (and a stateful data source's own state), the states of
the user's registered objects (`user_state`) and the detectors' histories
(`detectors.history`: plain numbers). Restoring one puts the loop back at
that boundary exactly: the same batches, the same random draws, the same
numbers, the same verdicts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from remedy.rank.state import sharding

# Re-exported: the rest of the rank takes them from here, with the snapshots that hold them.
from remedy.rank.state.rng import capture_rng as capture_rng
from remedy.rank.state.rng import restore_rng as restore_rng


def clone_to_host(tree: Any, into: Any = None) -> Any:
    """Deep-copy a state tree, moving every tensor to host memory.

    With `into` (a tree of the same shape that nothing else uses any more,
    such as the snapshot about to be evicted), matching host tensors are
    overwritten in place: a fresh multi-GB allocation costs far more in page
    faults than the copy itself.
    """
    if sharding.is_dtensor(tree):  # a sharded model's state: this rank's shard, never gathered
        return sharding.clone_shard(tree, into)
    if isinstance(tree, torch.Tensor):
        if (
            isinstance(into, torch.Tensor)
            and into.device.type == "cpu"
            and into.shape == tree.shape
            and into.dtype == tree.dtype
        ):
            return into.copy_(tree.detach())
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        other = into if isinstance(into, dict) else {}
        return {k: clone_to_host(v, other.get(k)) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        same = isinstance(into, list | tuple) and len(into) == len(tree)
        items = [clone_to_host(v, into[i] if same else None) for i, v in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def blank_like(tree: Any) -> Any:
    """A tree shaped like `tree` whose tensors are new zero-filled host tensors.

    Filling touches every page, so a later `clone_to_host(..., into=blank)`
    copies without page faults: the Guard builds one on a helper thread
    while the ring fills, so the copy at the next snapshot is the only cost.
    """
    if isinstance(tree, sharding.LocalShard):
        return sharding.blank_shard(tree)
    if isinstance(tree, torch.Tensor):
        return torch.zeros(tree.shape, dtype=tree.dtype, device="cpu")
    if isinstance(tree, dict):
        return {k: blank_like(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        items = [blank_like(v) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


@dataclass
class Snapshot:
    """Restorable state at the boundary before `step`."""

    step: int
    tick: int
    cursor: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    rng: dict[str, Any]
    lr_scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)
    # The user's registered objects' states, by name (`user_state.UserState.capture`).
    user: dict[str, Any] = field(default_factory=dict)
    # A stateful data source's state (`data.BatchCursor.source_state`); None for the others.
    data: dict[str, Any] | None = None
    # The detectors' histories at the boundary; None where none were taken (an older
    # checkpoint's): restoring it resets the detectors.
    detectors: dict[str, Any] | None = None

    def to_state(self) -> dict[str, Any]:
        """A plain dict for `torch.save`."""
        return {
            "step": self.step,
            "tick": self.tick,
            "cursor": self.cursor,
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "rng": self.rng,
            "lr_scale": self.lr_scale,
            "extra": self.extra,
            "user": self.user,
            "data": self.data,
            "detectors": self.detectors,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Snapshot:
        """The snapshot `to_state` wrote (one written before `user`/`data` existed loads too)."""
        return cls(**state)


class SnapshotRing:
    """The newest `capacity` snapshots, in memory; old ones fall off the end."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"snapshot ring capacity must be at least 1, got {capacity}")
        self._ring: deque[Snapshot] = deque(maxlen=capacity)

    def push(self, snap: Snapshot) -> None:
        # A rollback rewinds the step; snapshots from the abandoned timeline
        # at or after the new one are no longer reachable states.
        while self._ring and self._ring[-1].step >= snap.step:
            self._ring.pop()
        self._ring.append(snap)

    def recyclable(self, step: int) -> Snapshot | None:
        """The snapshot that pushing one at `step` will evict (the oldest of a full ring), if any."""
        if self.full and self._ring[-1].step < step:
            return self._ring[0]
        return None

    @property
    def full(self) -> bool:
        return len(self._ring) == self._ring.maxlen

    @property
    def capacity(self) -> int:
        return self._ring.maxlen or 0

    def newest_at_or_before(self, step: int) -> Snapshot | None:
        """The newest snapshot whose step is at most `step`."""
        for snap in reversed(self._ring):
            if snap.step <= step:
                return snap
        return None

    def drop_after(self, step: int) -> None:
        """Forget snapshots newer than `step` (after restoring to `step`)."""
        while self._ring and self._ring[-1].step > step:
            self._ring.pop()

    def steps(self) -> list[int]:
        return [s.step for s in self._ring]

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self) -> Iterator[Snapshot]:
        return iter(self._ring)
