"""The time Lightning's fit loop waits for its batches, as the loader's wait of each step.

Lightning fetches a batch ahead (`_PrefetchDataFetcher`): the batch of the
next step is fetched while the current one is handed over, and with gradient
accumulation the batches of one optimizer step are fetched between its
micro-batches. Measured as the time between two steps, a stall there is
either missed (it lands inside a step, counted as step time) or joined by
whatever else runs between steps (an evaluation, a checkpoint save).

The fit loop's epoch loop brackets each `next()` on the train dataloader with
two profiler marks (`_on_before_fetch`, `_on_after_fetch`, which it hands to
its data fetcher at every epoch's start). `time_fetches` wraps those two on
the epoch loop, so every fetch is timed exactly, wherever it falls, and the
user's profiler still gets its marks. Where a Lightning version has no such
marks, the loader's wait stays the time between steps (`LoopStep.fetched`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from remedy.integrations._loop import LoopStep

log = structlog.get_logger("remedy.integrations")

_MARKS = ("_on_before_fetch", "_on_after_fetch")  # the epoch loop's, around each fetch
_FETCHER_MARKS = ("_start_profiler", "_stop_profiler")  # where its data fetcher keeps them


class FetchTimer:
    """The fit loop's fetch marks, wrapped to time each fetch into `step`; `remove` unwraps."""

    def __init__(self, trainer: Any, epoch_loop: Any, step: LoopStep) -> None:
        self._trainer = trainer
        self._epoch_loop = epoch_loop
        before, after = (getattr(epoch_loop, name) for name in _MARKS)

        def on_before_fetch() -> None:
            before()
            step.fetch_began()

        def on_after_fetch() -> None:
            step.fetch_ended()
            after()

        self._wrapped = (on_before_fetch, on_after_fetch)
        for name, fn in zip(_MARKS, self._wrapped, strict=True):
            setattr(epoch_loop, name, fn)  # an instance attribute: the class's stays as it is
        # A fetcher set up before the callback started holds the epoch loop's own marks.
        fetcher = self._fetcher()
        if fetcher is not None:
            for name, fn in zip(_FETCHER_MARKS, self._wrapped, strict=True):
                setattr(fetcher, name, fn)

    def _fetcher(self) -> Any:
        fetcher = getattr(self._trainer.fit_loop, "_data_fetcher", None)
        if fetcher is None or not all(hasattr(fetcher, n) for n in _FETCHER_MARKS):
            return None
        return fetcher

    def remove(self) -> None:
        """The epoch loop's marks as they were (the trainer may fit again without remedy)."""
        for name in _MARKS:
            self._epoch_loop.__dict__.pop(name, None)
        fetcher = self._fetcher()
        if fetcher is not None:
            for mark, name, ours in zip(_MARKS, _FETCHER_MARKS, self._wrapped, strict=True):
                if getattr(fetcher, name) is ours:
                    setattr(fetcher, name, getattr(self._epoch_loop, mark))


def time_fetches(trainer: Any, step: LoopStep) -> FetchTimer | None:
    """Time the fit loop's fetches into `step`'s loader wait; None where this Lightning has no
    fetch marks (the wait is then the time between steps)."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if epoch_loop is None or not all(callable(getattr(epoch_loop, n, None)) for n in _MARKS):
        log.info("loader wait measured between steps: this Lightning has no fetch marks")
        return None
    return FetchTimer(trainer, epoch_loop, step)
