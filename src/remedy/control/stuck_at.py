"""The step a lost rank stopped at, from the ranks' own answers to the ping that found it.

A rank reports its steps only every heartbeat (0.5 s, many steps of a small
model), so the supervisor's last report of a rank lags the step it hung at;
a hung rank's peers wait for it inside that step's collective, and their
ping answers (`Membership.status`: `step`, `tick`) say which one. A hung
rank that still answers says where it is itself. `stuck_at` puts that step
in a finding's details (`step`, `tick`), which the lost rank's anomaly then
records (`LostRanks`: the step is the later of it and the last report).

No Ray, no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from remedy.control.hang_check import Finding


def _where(answer: Any) -> tuple[int, int] | None:
    """(step, tick) of a ping answer that says both, else None."""
    if not isinstance(answer, Mapping):
        return None
    step, tick = answer.get("step"), answer.get("tick")
    if type(step) is int and type(tick) is int and step >= 0 and tick >= 0:
        return step, tick
    return None


def front(answers: Mapping[int, Any]) -> tuple[int, int] | None:
    """The furthest (step, tick) any answer reached: where the group waits."""
    return max((w for w in map(_where, answers.values()) if w is not None), default=None)


def stuck_at(finding: Finding, answers: Mapping[int, Any]) -> Finding:
    """`finding` with the step and tick its rank stopped at: its own answer's if it gave one
    (it answers, but its training is stuck), else the front its peers wait at."""
    where = _where(answers.get(finding.rank)) or front(answers)
    if where is None:
        return finding
    details = {**(finding.details or {}), "step": where[0], "tick": where[1]}
    return replace(finding, details=details)
