"""Where a supervised Guard step's time goes, measured inside the ranks of a real run.

`Pieces` wraps the Guard's per-step calls (the boundary and what it calls, the
step mark, the data, the step's own parts, the report) with timers on the
instances the Guard holds, so a `supervised_target.py --pieces` run can say
per piece how many microseconds a guarded step spends there, beside the same
pieces of the plain loop (zero_grad, forward and backward, optimizer and
scheduler steps). Nested pieces are indented under the one that calls them.
A wrapper costs well under a microsecond a call; the ratio is measured
without them (`--pieces` is a separate run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

# (name, path from the Guard to the object, method). Nesting is found as the run goes: a
# piece called inside another is keyed under it, and only the outermost count toward the
# step's accounted time.
GUARDED: list[tuple[str, str, str]] = [
    ("boundary", "", "_boundary"),
    ("reporter.poll", "reporter", "poll"),
    ("agreement.agreed", "agreement", "agreed"),
    ("agreement.launch", "agreement", "launch"),
    ("snapshot", "", "_snapshot"),
    ("replays.mark (RNG capture)", "replays", "mark"),
    ("membership.mark", "membership", "mark"),
    ("data: cursor.next", "cursor", "next"),
    ("replays.fetched", "replays", "fetched"),
    ("phases.begin", "phases", "begin"),
    ("phase exchange launch", "phases.exchange", "launch"),
    ("zero_grad", "executor.optimizer", "zero_grad"),
    ("forward_backward", "executor", "forward_backward"),
    ("finish_grads (norm)", "executor", "finish_grads"),
    ("agreement.for_sync (wait)", "agreement", "for_sync"),
    ("phases.for_sync (wait)", "phases", "for_sync"),
    ("executor.read_all (host sync)", "executor", "read_all"),
    ("agreement.settle", "agreement", "settle"),
    ("phases.note", "phases", "note"),
    ("detectors.flags (_keep_if_flagged)", "", "_keep_if_flagged"),
    ("optimizer_step (+scheduler)", "executor", "optimizer_step"),
    ("finish_step", "", "_finish_step"),
    ("memory read", "_memory", "read"),
    ("detectors.observe", "detectors", "observe"),
    ("phases.end", "phases", "end"),
    ("learning.observe", "learning", "observe"),
    ("outbox.metrics", "outbox", "metrics"),
    ("send", "", "_send"),
]


# The total of the outermost pieces' time (what the step's pieces account for).
OUTERMOST = "(outermost pieces together)"
# Between a caller's name and its callee's in a key.
SEP = " / "


class Pieces:
    """Per-piece time totals of the calls it wraps, counted while `on`, keyed by where each
    was called: "boundary / agreement.agreed" is `agreed` called inside the boundary."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}  # in the order first called: a caller before its callees
        self.calls: dict[str, list[float]] = {}  # each call's seconds, while `on`
        self.on = False
        self._path: list[str] = []

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        """Time `obj.attr(...)` as `name` from now on (an instance attribute over the method)."""
        fn: Callable[..., Any] = getattr(obj, attr)
        total, path = self.total, self._path

        def timed(*args: Any, **kwargs: Any) -> Any:
            key = SEP.join([*path, name])
            total.setdefault(key, 0.0)
            outermost = not path
            path.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                path.pop()
                if self.on:
                    dt = time.perf_counter() - t0
                    total[key] += dt
                    self.calls.setdefault(key, []).append(dt)
                    if outermost:
                        total[OUTERMOST] = total.get(OUTERMOST, 0.0) + dt

        setattr(obj, attr, timed)

    def wrap_guard(self, guard: Any) -> None:
        """Wrap each of `GUARDED`'s pieces this Guard has (a piece whose object is None, such as
        the agreement alone in one process, is left out)."""
        for name, path, attr in GUARDED:
            obj = guard
            for part in filter(None, path.split(".")):
                obj = getattr(obj, part, None)
            if obj is not None and hasattr(obj, attr):
                self.wrap(obj, attr, name)
        for i, inspector in enumerate(getattr(guard, "_batch_inspectors", [])):
            self.wrap(
                inspector, "inspect_batch", f"batch inspector {i} ({type(inspector).__name__})"
            )

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run `fn` and count its time as `name` (the plain loop's pieces)."""
        self.total.setdefault(name, 0.0)
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            if self.on:
                dt = time.perf_counter() - t0
                self.total[name] += dt
                self.calls.setdefault(name, []).append(dt)

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` as `name` while `on` (a whole chunk's steps)."""
        if self.on:
            self.total[name] = self.total.get(name, 0.0) + seconds

    def per_step(self, steps: int) -> dict[str, float]:
        """Microseconds per step of each piece, by key (the mean over the steps)."""
        return {k: v / max(steps, 1) * 1e6 for k, v in self.total.items()}

    def typical(self, steps: int) -> dict[str, float]:
        """Microseconds per step of each piece as its median call times its calls per step:
        on a loaded machine, where a few preempted calls swell the mean."""
        return {
            k: statistics.median(v) * len(v) / max(steps, 1) * 1e6 for k, v in self.calls.items()
        }
