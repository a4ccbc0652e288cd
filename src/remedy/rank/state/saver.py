"""Snapshots and checkpoints of one rank: what it keeps to go back to, and how.

At each snapshot boundary the `Saver` takes the rank's state into the
cheapest buffers at hand, keeps it in the in-memory ring (`SnapshotRing`:
what `rollback` restores), mirrors it to a buddy rank for a sharded model
(`shard_mirror`), and, when a checkpoint is due, hands it to the durable
store (`CheckpointStore` or DCP), whose write runs on its own thread.

Buffers: a full ring hands over the snapshot it is about to evict, unless
the checkpoint writer still reads it. While the ring fills there is none,
and a fresh multi-GB host copy spends most of its time in page faults
(1.6 s of a 50M-parameter model's 1.8 s step on CPU): a helper thread fills
buffers shaped like the newest snapshot in the meantime (torch releases the
GIL while filling), and the next snapshot copies into them if they are
ready. If that thread fails (out of host memory, say), snapshots go to fresh
memory and no more buffers are prepared.

What went wrong is kept for the rank to report at its next boundary: writes
that failed after the store's retries (appended by the writer thread) and
checksum failures met while restoring.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import structlog

from remedy.rank.chaos import process_faults
from remedy.rank.loop import waits
from remedy.rank.state.snapshots import Snapshot, SnapshotRing, blank_like

if TYPE_CHECKING:
    from remedy.rank.state.checkpoint_store import CheckpointStore
    from remedy.rank.state.shard_mirror import ShardMirror

log = structlog.get_logger("remedy.saver")

_DONE: Future[Any] = Future()
_DONE.set_result(None)


def blank_snapshot(like: Snapshot) -> Snapshot:
    """Zero-filled (page-faulted) host buffers shaped like `like`'s model and optimizer state."""
    return dataclasses.replace(
        like, model=blank_like(like.model), optimizer=blank_like(like.optimizer)
    )


class Saver:
    """See the module docstring. `checkpoints` and `mirror` are None where there are none."""

    def __init__(
        self,
        ring: int,
        checkpoints: CheckpointStore | None,
        mirror: ShardMirror | None,
        *,
        rank: int,
    ) -> None:
        self.snapshots = SnapshotRing(ring)
        self.checkpoints = checkpoints
        self.mirror = mirror
        self.rank = rank
        self._writes: dict[int, Future[Any]] = {}  # writes in flight, by id of the snapshot read
        self.spare: Future[Snapshot] | None = None  # buffers being prepared for the next snapshot
        self._pool: ThreadPoolExecutor | None = None
        self._prepare_spares = True
        self._write_failures: deque[tuple[int, str]] = deque()
        self._corrupt: list[tuple[int, str]] = []
        if checkpoints is not None:
            checkpoints.on_corrupt = lambda step, error: self._corrupt.append((step, error))

    def save(
        self,
        step: int,
        take: Callable[[Snapshot | None], Snapshot],
        *,
        extra: Callable[[], dict[str, Any]] | None = None,
        write_fault: bool = False,
    ) -> Snapshot:
        """Snapshot this boundary (`take(into)` copies the rank's state into `into`, or into
        fresh memory for None) and return it; with `extra`, a checkpoint is due: it is written
        with `extra()` beside the snapshot. `write_fault` (chaos): that write meets a
        file-size limit of 0, waited for here so the limit is lifted before training writes."""
        reuse = self.snapshots.recyclable(step)
        if reuse is not None and not self._writes.pop(id(reuse), _DONE).done():
            reuse = None  # the checkpoint writer still reads it
        if reuse is None and self.spare is not None and self.spare.done():
            spare, self.spare = self.spare, None
            failed = spare.exception()
            if failed is None:
                reuse = spare.result()  # done
            else:
                log.warning("snapshot buffers not prepared; not trying again", error=repr(failed))
                self._prepare_spares = False
        snap = take(reuse)
        self.snapshots.push(snap)
        if self.mirror is not None:
            self.mirror.push(snap)
        if self.checkpoints is not None and extra is not None:
            snap.extra = extra()
            if write_fault:
                with process_faults.file_size_limit(0):
                    write = self.checkpoints.save(snap)
                    futures.wait([write])
            else:
                write = self.checkpoints.save(snap)
            write.add_done_callback(lambda done: self._write_done(done, step))
            self._writes[id(snap)] = write
        if not self.snapshots.full and self.spare is None and self._prepare_spares:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="remedy-snapshot")
            self.spare = self._pool.submit(blank_snapshot, snap)
        return snap

    def _write_done(self, write: Future[Any], step: int) -> None:
        """The checkpoint write of `step` ended (on the writer thread): a failure is kept for the
        next boundary; training goes on, the previous checkpoint stands."""
        failed = write.exception()
        if failed is not None:
            log.error("checkpoint_write_failed", rank=self.rank, step=step, error=str(failed))
            self._write_failures.append((step, str(failed)))

    def write_failures(self) -> list[tuple[int, str]]:
        """(checkpoint step, error) of each write that failed since the last call."""
        found = []
        while self._write_failures:  # appended from the checkpoint writer's thread
            found.append(self._write_failures.popleft())
        return found

    def corrupt(self) -> list[tuple[int, str]]:
        """(checkpoint step, error) of each checksum failure met while restoring, since the last
        call."""
        found, self._corrupt = self._corrupt, []
        return found

    def start_over(self, snap: Snapshot) -> None:
        """Keep only `snap`: every rank of a re-formed group restarts its ring from the same
        boundary (a replacement has no ring of its own)."""
        self.snapshots = SnapshotRing(self.snapshots.capacity)
        self.snapshots.push(snap)

    def close(self) -> None:
        """Wait for the durable writes and the mirror; drop buffers no snapshot will use."""
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.mirror is not None:
            self.mirror.close()
        if self._pool is not None:
            if self.spare is not None:
                self.spare.cancel()
            waits.drain(self._pool, waits.POOL_S, "the snapshot-buffer pool")
            self.spare = None
