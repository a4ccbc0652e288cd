"""A returning supervisor judges each rank's stall from the rank's own progress marks.

A supervisor that Ray restarted knows of the ranks only what its predecessor
wrote down, which may be little (it died seconds after the group started) or
old; counting every rank's progress from its own return, as a fresh start,
gives a rank that hung meanwhile the start-up allowance (120 s) or a
first-step one (20 s) before anyone looks at it. The ranks know better: each
one's ping answer (`Membership.status`) says its tick, the wall time that
tick last moved (`moved_at`) and how many steps this process began
(`steps_run`). `marks` turns one round of answers into where each rank's
progress stands, for `HangWatch.marked`:

- a rank that answers from inside its loop stalled from its own mark;
- a rank that does not answer (stopped, wedged) while every rank that does is
  inside its loop stalled the group: it has not moved since the oldest mark
  among them (its peers wait for it in the collective they began then), at
  the furthest tick they reached, and had stepped as they had.

A rank in recovery, starting, or gone gets no mark (a restart under way has
its own checks). No Ray, no I/O: times are given (`wall`: the epoch clock
the marks are in; `now`: the watch's monotonic clock).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from remedy.control.hang_watch import NO_ANSWER
from remedy.protocol import phases
from remedy.protocol.phases import IN_LOOP


@dataclass(frozen=True, slots=True)
class Mark:
    """Where a rank's progress stands: at `tick` since `since` (monotonic), `ran` steps run."""

    tick: int
    since: float
    ran: int


def _own(answer: Any, *, wall: float, now: float) -> Mark | None:
    if phases.of(answer) not in IN_LOOP:
        return None
    tick, moved, ran = answer.get("tick"), answer.get("moved_at"), answer.get("steps_run", 0)
    if type(tick) is not int or tick < 0 or type(ran) is not int or ran < 0:
        return None
    if not isinstance(moved, int | float) or isinstance(moved, bool) or not math.isfinite(moved):
        return None
    # A mark from a clock ahead of this one says the rank moved just now, never later.
    return Mark(tick, now - max(wall - float(moved), 0.0), ran)


def marks(pings: Mapping[int, Any], *, wall: float, now: float) -> dict[int, Mark]:
    """Each rank's progress by the marks of one ping round (see the module docstring)."""
    out: dict[int, Mark] = {}
    for rank, answer in pings.items():
        mark = _own(answer, wall=wall, now=now)
        if mark is not None:
            out[rank] = mark
    silent = [r for r, a in pings.items() if a is NO_ANSWER]
    answered = [r for r, a in pings.items() if isinstance(a, Mapping)]
    if silent and answered and all(r in out for r in answered):
        oldest = min(out[r].since for r in answered)
        front = max(out[r].tick for r in answered)
        ran = min(out[r].ran for r in answered)
        for rank in silent:
            out[rank] = Mark(front, oldest, ran)
    return out
