"""Phases: when a rank is outside training on purpose, and for how long it may be.

A rank is in a *phase* when it does something other than its training step
that its peers must wait for: an evaluation or a checkpoint on rank 0 only,
a log flush, a `torch.compile` (re)compile, its first steps. A phase is

- **declared**: `with guard.phase("eval"):` (any name; `eval`, `save`, `log`
  are the usual ones), and remedy's own snapshot and checkpoint saves
  (`save`);
- **measured**: the time between the end of one `guard.step` and the start of
  the next on this rank, beyond the step itself (whatever the loop did in
  between, declared or not, and the Guard's own boundary work);
- **warm-up**: the first `WARMUP_STEPS` steps after the rank starts or its
  group re-forms, and a step in which `torch.compile` compiled (and the one
  after it).

Each phase has a bound (`GuardConfig.phase_bound_s`, by name in
`GuardConfig.phase_bounds`, or `guard.phase(name, bound_s=...)`); one that
lasts past it is reported as `phase_overrun`, naming the phase, when it ends.

`PhaseClock` keeps this rank's phases (pure bookkeeping with an injectable
clock). `PhaseExchange` tells the group, once per step, how late each rank
came to the step and whether any is warming up (two numbers in the step's one
small all-reduce, the command agreement's, read in the step's one host sync),
so a rank that waited for a peer's phase in the step's collectives knows it
(`phase_wait_s`) and the detectors that judge waiting (`collective_slow`, the
supervisor's straggler watch) leave it out.
The phase travels to the supervisor in the ping answer (`status`, the
`loop_phase` key), which the hang watch reads: a rank within its phase's
bound is never named hung for being behind its peers.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from remedy.policies import AnomalyEvent
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats

# Steps after a (re)start of the rank or of its group that are a warm-up phase: DDP builds its
# buckets, allocators and kernels warm up, and ranks start at different times.
WARMUP_STEPS = 3
# The bound of a phase without a bound of its own (GuardConfig.phase_bound_s's default), s.
DEFAULT_BOUND_S = 300.0
# The measured phase between two steps is named so in the ping answer and events.
BETWEEN = "between_steps"
COMPILE = "compile"
SAVE = "save"
# Shorter measured gaps are the loop's ordinary overhead, not worth a metrics key.
NOTED_S = 0.01


@dataclass
class _Open:
    name: str
    started: float  # the clock's time
    bound_s: float


@dataclass(frozen=True)
class Overrun:
    """A phase that lasted past its bound."""

    name: str
    seconds: float
    bound_s: float


@dataclass
class PhaseClock:
    """This rank's phases: declared, measured between steps, warm-up and compiles."""

    bound_s: float = DEFAULT_BOUND_S
    bounds: dict[str, float] = field(default_factory=dict)
    warmup_steps: int = WARMUP_STEPS
    clock: Callable[[], float] = time.monotonic
    _open: list[_Open] = field(default_factory=list)
    _step_ended: float | None = None  # None: inside a step, or before the first
    _warm_left: int = 0
    _compiling: float | None = None  # a compile started at this time and is under way
    _compiled: bool = False  # a compile ran in the current step
    _overruns: list[Overrun] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _callbacks: tuple[Any, Any] | None = None

    def __post_init__(self) -> None:
        self._warm_left = self.warmup_steps
        self._step_ended = self.clock()  # the time before the first step is a phase too

    # ------------------------------------------------------------ declared
    def bound_of(self, name: str, bound_s: float | None = None) -> float:
        """The bound of phase `name`: the given one, its entry in `bounds`, else `bound_s`."""
        if bound_s is not None:
            return float(bound_s)
        return float(self.bounds.get(name, self.bound_s))

    @contextlib.contextmanager
    def phase(self, name: str, *, bound_s: float | None = None) -> Iterator[None]:
        """Mark the code inside as phase `name` (see the module docstring)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a phase needs a name (a non-empty string), not {name!r}")
        entry = _Open(name, self.clock(), self.bound_of(name, bound_s))
        with self._lock:
            self._open.append(entry)
        try:
            yield
        finally:
            with self._lock:
                self._open.remove(entry)
            took = self.clock() - entry.started
            if took > entry.bound_s:
                self._overruns.append(Overrun(name, took, entry.bound_s))

    # ------------------------------------------------------------ measured
    def step_begins(self) -> float:
        """A step starts: the measured phase before it (s; 0 right after a step ended early)."""
        now = self.clock()
        ended, self._step_ended = self._step_ended, None
        self._compiled = self._compiling is not None
        if ended is None:
            return 0.0
        gap = now - ended
        bound = self.bound_of(BETWEEN)
        # A declared phase inside the gap has reported its own overrun, if any.
        if gap > bound and not self._overruns:
            self._overruns.append(Overrun(BETWEEN, gap, bound))
        return gap

    def step_ends(self) -> None:
        """The step ended: the warm-up counts it, and the measured phase begins."""
        self._step_ended = self.clock()
        if self._warm_left > 0:
            self._warm_left -= 1
        if self._compiled:
            # The step after a compile warms up too (autotuning, caches).
            self._warm_left = max(self._warm_left, 1)

    def restart_warmup(self) -> None:
        """The group re-formed (or the rank restarted): its first steps warm up again."""
        self._warm_left = self.warmup_steps

    @property
    def warming(self) -> bool:
        """Whether the current step is a warm-up step (or compiled) on this rank."""
        return self._warm_left > 0 or self._compiled

    def overruns(self) -> list[Overrun]:
        """The phases that ended past their bound since the last call."""
        out, self._overruns = self._overruns, []
        return out

    # ------------------------------------------------------------- compiles
    def watch_compiles(self) -> None:
        """Count `torch.compile`'s compiles as a phase, once torch._dynamo is in use here.

        Cheap to call every step: it registers torch's compile callbacks the first
        time torch._dynamo is imported (a loop that never compiles never imports it).
        """
        if self._callbacks is not None or "torch._dynamo" not in sys.modules:
            return
        from torch._dynamo.callback import callback_handler  # noqa: PLC0415

        def started(_args: Any = None) -> None:
            self._compiling = self.clock()
            self._compiled = True

        def ended(_args: Any = None) -> None:
            self._compiling = None

        callback_handler.register_start_callback(started)
        callback_handler.register_end_callback(ended)
        self._callbacks = (started, ended)

    def close(self) -> None:
        """Unregister the compile callbacks (they are process-wide)."""
        if self._callbacks is None:
            return
        from torch._dynamo.callback import callback_handler  # noqa: PLC0415

        started, ended = self._callbacks
        self._callbacks = None
        with contextlib.suppress(ValueError):
            callback_handler.remove_start_callback(started)
            callback_handler.remove_end_callback(ended)

    # -------------------------------------------------------------- status
    def status(self) -> dict[str, Any] | None:
        """The phase this rank is in now, for the ping answer (None: training).

        `{"name", "for_s", "bound_s"}`: the innermost declared phase, else a
        compile under way, else the measured phase between steps.
        """
        now = self.clock()
        with self._lock:
            inner = self._open[-1] if self._open else None
        if inner is not None:
            return _status(inner.name, now - inner.started, inner.bound_s)
        compiling = self._compiling
        if compiling is not None:
            return _status(COMPILE, now - compiling, self.bound_of(COMPILE))
        ended = self._step_ended
        if ended is not None:
            return _status(BETWEEN, now - ended, self.bound_of(BETWEEN))
        return None


def _status(name: str, seconds: float, bound_s: float) -> dict[str, Any]:
    return {"name": name, "for_s": round(max(seconds, 0.0), 3), "bound_s": bound_s}


class PhaseExchange:
    """Each step, the group's latest arrival and whether any rank warms up, at no collective or
    sync of its own.

    `told(late_s, warming)` gives this rank's numbers as the step begins (its
    measured phase before the step in ms, warming 0/1); they travel in the
    step's one all-reduce, the command agreement's (`rank.link.inbox.Agreement`,
    which takes the group's MAX of each), read in the step's one host sync.
    `wait_of(values)` turns the group's numbers into this rank's wait for a
    peer's phase.
    """

    def __init__(self) -> None:
        self._late_s = 0.0

    def told(self, late_s: float, *, warming: bool) -> tuple[int, bool]:
        """(ms late, warming): what this rank tells the group as its step begins."""
        self._late_s = late_s
        return round(late_s * 1000.0), warming

    def wait_of(self, values: list[float] | None) -> tuple[float, bool]:
        """(seconds this rank waited for a later peer's phase, whether any rank warms up)."""
        if values is None:
            return 0.0, False
        latest_s = float(values[0]) / 1000.0
        return max(latest_s - self._late_s, 0.0), bool(values[1])


class LoopPhases:
    """The Guard's phases: its `PhaseClock` and, in a process group, its `PhaseExchange`.

    The Guard calls `begin` as a step starts (which gives the numbers to tell
    the group, in the step's agreement), `note` with what the step's host sync
    read to put the step's phase numbers in its stats, and `end` as it ends.
    """

    def __init__(self, bound_s: float = DEFAULT_BOUND_S, bounds: dict[str, float] | None = None):
        self.clock = PhaseClock(bound_s=bound_s, bounds=dict(bounds or {}))
        self.exchange: PhaseExchange | None = None
        self._late_s = 0.0

    def use_group(self) -> None:
        """Exchange with a group from now on (a new generation): its first steps warm up."""
        self.exchange = PhaseExchange()
        self.clock.restart_warmup()

    def begin(self) -> tuple[int, bool]:
        """A step starts: measure the phase before it; (ms late, warming) to tell the group."""
        self.clock.watch_compiles()
        self._late_s = self.clock.step_begins()
        if self.exchange is None:
            return 0, False
        return self.exchange.told(self._late_s, warming=self.clock.warming)

    def note(self, values: list[float] | None, extra: dict[str, Any]) -> None:
        """Put the step's phase numbers into its stats' `extra` (they reach metrics.jsonl):
        `phase_s` (this rank's own phase before the step), `phase_wait_s` (the time it
        waited for a peer's), `phase_warmup` (this rank or a peer warms up)."""
        if self._late_s >= NOTED_S:
            extra["phase_s"] = round(self._late_s, 4)
        waited, warming = (
            self.exchange.wait_of(values) if self.exchange is not None else (0.0, False)
        )
        if waited >= NOTED_S:
            extra["phase_wait_s"] = round(waited, 4)
        if warming or self.clock.warming:
            extra["phase_warmup"] = True

    def end(self) -> list[Overrun]:
        """The step ended; the phases that overran their bound since the last step."""
        self.clock.step_ends()
        return self.clock.overruns()

    def status(self) -> dict[str, Any] | None:
        return self.clock.status()

    def close(self) -> None:
        self.clock.close()


def overrun_event(stats: StepStats, overrun: Overrun) -> AnomalyEvent:
    """The `phase_overrun` event of a phase that lasted past its bound."""
    return event(
        stats,
        "phase_overrun",
        value=round(overrun.seconds, 3),
        threshold=overrun.bound_s,
        severity="warning",
        phase=overrun.name,
    )
