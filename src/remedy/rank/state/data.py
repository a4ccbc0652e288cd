"""The Guard's view of the training data: a position that can be saved, restored and skipped.

An indexable source (`source[i]` or `source(i)` returns batch `i`) gives
exact rollback: the position is an integer and a skipped batch is an index
never asked for. An iterable with `state_dict()`/`load_state_dict()` (a
torchdata `StatefulDataLoader`) is rewound exactly too: every snapshot holds
its state (`source_state`) and a rollback loads it back (`restore_source`).
Any other plain iterable (a `DataLoader`, a list, a generator) still trains
and can skip forward, but a rollback cannot rewind it; the rollback's result
says so.

Running out of data is the normal end of a loop: the cursor raises
`DataExhausted` and the Guard ends training cleanly. With `epochs=N` a
re-iterable source (a `DataLoader`, a list, a `Dataset` of batches with a
length) is read N times; before each pass the cursor calls `set_epoch(epoch)`
on the source's sampler where it has one (a `DistributedSampler`), so every
epoch is shuffled differently and every rank reads its own shard.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog

from remedy.rank.state.snapshots import clone_to_host

log = structlog.get_logger("remedy.data")


class DataExhausted(Exception):
    """The source has no more batches (after the last epoch asked for)."""


class BatchCursor:
    """Serves batches in index order, honouring a set of skipped indices.

    `position` counts batches over all epochs; `epoch` is the pass now being read.
    """

    def __init__(self, source: Any, *, epochs: int | None = None) -> None:
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be at least 1, got {epochs}")
        self._source = source
        self._fetch: Callable[[int], Any] | None = None
        self._iter: Iterator[Any] | None = None
        self._length: int | None = None
        self.epochs = epochs
        if callable(getattr(source, "__getitem__", None)) and not isinstance(source, Iterator):
            self._fetch = source.__getitem__
            length = getattr(source, "__len__", None)
            self._length = int(length()) if callable(length) else None
        elif callable(source):
            self._fetch = source
        elif isinstance(source, Iterable):
            if epochs is not None and epochs > 1 and isinstance(source, Iterator):
                raise ValueError(
                    "epochs > 1 needs a source that can be iterated again (a DataLoader, "
                    "a list); a generator or iterator is read once"
                )
        else:
            raise TypeError("data must be indexable (source[i]), callable (source(i)) or iterable")
        if epochs is not None and epochs > 1 and self._fetch is not None and self._length is None:
            raise ValueError("epochs > 1 with indexable data needs its length (len(data))")
        # An iterable that saves and loads its own position (torchdata's StatefulDataLoader).
        self._stateful = (
            self._fetch is None
            and callable(getattr(source, "state_dict", None))
            and callable(getattr(source, "load_state_dict", None))
        )
        self.position = 0
        self.epoch = 0
        self._epoch_start = 0  # position of the first batch of the current epoch
        self.skipped: set[int] = set()
        # A plain iterable's batches to yield again before reading on (see `unread`).
        self._again: deque[tuple[int, Any]] = deque()
        # Batches this process has drawn from a plain iterable, over its epochs; below the
        # position after a resume or an adoption, the next read catches up (`_catch_up`).
        self.drawn = 0
        self.caught_up = 0  # batches read and dropped to catch up, in this process

    @property
    def rewindable(self) -> bool:
        """Whether any position can be read again by index (`seek`)."""
        return self._fetch is not None

    @property
    def restorable(self) -> bool:
        """Whether the source's own state is saved and loaded (`source_state`), so a rollback
        rewinds it exactly though it cannot seek."""
        return self._stateful

    def source_state(self) -> dict[str, Any] | None:
        """A stateful source's state at this boundary, with the cursor's (None for the others)."""
        if not self._stateful:
            return None
        return {
            "position": self.position,
            "epoch": self.epoch,
            "epoch_start": self._epoch_start,
            "drawn": self.drawn,
            "again": list(self._again),  # batches given back by a replay, still to be yielded
            "state": clone_to_host(self._source.state_dict()),
        }

    def restore_source(self, saved: dict[str, Any] | None) -> None:
        """Put a stateful source back where `source_state` found it; the next read resumes there."""
        if not self._stateful or saved is None:
            return
        self._source.load_state_dict(clone_to_host(saved["state"]))
        self.position = int(saved["position"])
        self.epoch = int(saved["epoch"])
        self._epoch_start = int(saved["epoch_start"])
        self.drawn = int(saved["drawn"])
        self._again = deque(saved["again"])
        # A new iterator resumes from the loaded state (the epoch's sampler seed set first).
        self._iter = None

    def next(self) -> tuple[int, Any]:
        """(index, batch) of the next batch that is not skipped; raises DataExhausted at the end."""
        while self._again:
            index, batch = self._again.popleft()
            self.position = index + 1
            if index not in self.skipped:
                return index, batch
        if self._fetch is None and self.drawn < self.position:
            self._catch_up()
        while self.position in self.skipped:
            self._read()
            self.position += 1
        index = self.position
        batch = self._read()
        self.position += 1
        return index, batch

    def _catch_up(self) -> None:
        """Read and drop a plain iterable's batches up to the position.

        A fresh process whose position was set ahead (a resume from a durable
        checkpoint, a replacement adopting a peer's state) would otherwise train
        the source's first batches again under later step numbers; an indexable
        source simply reads at the position. The batches in between are read
        (a `DataLoader` loads them) and dropped, once, in order, over epochs.
        """
        target, start, t0 = self.position, self.drawn, time.perf_counter()
        while self.drawn < target:
            self._read()
        self.caught_up += target - start
        log.info(
            "data_caught_up",
            position=target,
            batches=target - start,
            seconds=round(time.perf_counter() - t0, 3),
        )

    def _read(self) -> Any:
        if self._fetch is not None:
            return self._fetch_at(self.position)
        if self._iter is None:
            self._start_epoch(self.epoch)
        assert self._iter is not None
        try:
            batch = next(self._iter)
        except StopIteration:
            pass
        else:
            self.drawn += 1
            return batch
        if not self._more_epochs(self.epoch + 1):
            raise DataExhausted(self._end_message())
        self.epoch += 1
        self._epoch_start = self.position
        self._start_epoch(self.epoch)
        try:
            batch = next(self._iter)
        except StopIteration:
            raise DataExhausted(f"epoch {self.epoch} of the data yielded no batch") from None
        self.drawn += 1
        return batch

    def _fetch_at(self, position: int) -> Any:
        assert self._fetch is not None
        if self._length is None:
            try:
                return self._fetch(position)
            except IndexError:
                raise DataExhausted(self._end_message()) from None
        epoch, index = divmod(position, self._length) if self._length else (0, position)
        if not self._length or not self._more_epochs(epoch):
            raise DataExhausted(self._end_message())
        if epoch != self.epoch:
            self.epoch = epoch
            self._set_epoch(epoch)
        return self._fetch(index)

    def _more_epochs(self, epoch: int) -> bool:
        return epoch < (self.epochs or 1)

    def _start_epoch(self, epoch: int) -> None:
        self._set_epoch(epoch)
        self._iter = iter(self._source)

    def _set_epoch(self, epoch: int) -> None:
        """Tell a sampler (e.g. DistributedSampler) which epoch starts, so each is shuffled anew."""
        samplers = [
            self._source,
            getattr(self._source, "sampler", None),
            getattr(getattr(self._source, "batch_sampler", None), "sampler", None),
        ]
        for sampler in samplers:
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
                return

    def _end_message(self) -> str:
        epochs = self.epochs or 1
        return f"data exhausted after {self.position} batches ({epochs} epoch{'s' * (epochs > 1)})"

    def skip_next(self, count: int) -> list[int]:
        """Mark the next `count` not-yet-skipped indices from the position as skipped."""
        out: list[int] = []
        index = self.position
        while len(out) < count:
            if index not in self.skipped:
                self.skipped.add(index)
                out.append(index)
            index += 1
        return out

    def unread(self, items: list[tuple[int, Any]]) -> None:
        """Give back batches already read, (index, batch) in order, to be yielded again first.

        A replay goes back to a step; an indexable source is simply read again from
        there (`seek`), a plain iterable cannot be, so the batches it yielded since are
        kept and handed back.
        """
        if self._fetch is not None or not items:
            return
        later = [x for x in self._again if x[0] > items[-1][0]]  # given back before, unread still
        self._again = deque([*items, *later])
        self.position = items[0][0]

    def seek(self, position: int) -> None:
        if self._fetch is None:
            return  # an iterator cannot go back; training continues from where it is
        self.position = position
