"""The Guard's view of the training data: a position that can be saved, restored and skipped.

An indexable source (`source[i]` or `source(i)` returns batch `i`) gives
exact rollback: the position is an integer and a skipped batch is an index
never asked for. A plain iterable still trains and can skip forward, but a
rollback cannot rewind it; the Guard says so in the action's result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any


class BatchCursor:
    """Serves batches in index order, honouring a set of skipped indices."""

    def __init__(self, source: Any) -> None:
        self._fetch: Callable[[int], Any] | None = None
        self._iter: Iterator[Any] | None = None
        if callable(getattr(source, "__getitem__", None)) and not isinstance(source, Iterator):
            self._fetch = source.__getitem__
        elif callable(source):
            self._fetch = source
        elif isinstance(source, Iterable):
            self._iter = iter(source)
        else:
            raise TypeError("data must be indexable (source[i]), callable (source(i)) or iterable")
        self.position = 0
        self.skipped: set[int] = set()

    @property
    def rewindable(self) -> bool:
        return self._fetch is not None

    def next(self) -> tuple[int, Any]:
        """(index, batch) of the next batch that is not skipped."""
        while self.position in self.skipped:
            if self._iter is not None:
                next(self._iter)
            self.position += 1
        index = self.position
        batch = self._fetch(index) if self._fetch is not None else next(self._iter)  # type: ignore[arg-type]
        self.position += 1
        return index, batch

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

    def seek(self, position: int) -> None:
        if self._fetch is None:
            return  # an iterator cannot go back; training continues from where it is
        self.position = position
