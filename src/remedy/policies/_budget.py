"""The disruption budget and inhibitions: what is in flight, and what it silences.

At most one disruptive action (rollback, restart_rank) is in flight at a
time: from the decision until `Engine.record_outcome`. While an action named
by an `inhibit:` entry is in flight, and for `warmup_steps` ticks after it
was applied, the listed anomalies fire no rule (a rollback makes the loss
jump; that jump is not a new spike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remedy.policies._rules import Inhibit


@dataclass(frozen=True, slots=True)
class Inhibition:
    """Why an anomaly is silenced now; `period` names the action decision responsible."""

    entry: Inhibit
    period: str
    in_flight: bool


class Budget:
    """In-flight tracked actions and the ticks at which inhibiting actions were applied."""

    def __init__(self) -> None:
        self.in_flight: dict[str, tuple[str, int, bool]] = {}  # id -> action, tick, disruptive
        self.applied: dict[str, tuple[int, str]] = {}  # action -> tick applied, decision id

    def busy(self) -> tuple[str, str] | None:
        """The (decision id, action) of an in-flight disruptive action, if any."""
        for decision_id, (action, _tick, disruptive) in self.in_flight.items():
            if disruptive:
                return decision_id, action
        return None

    def take(self, decision_id: str, action: str, tick: int, *, disruptive: bool) -> None:
        """Mark a decision as in flight."""
        self.in_flight[decision_id] = (action, tick, disruptive)

    def release(self, decision_id: str) -> str | None:
        """Forget an in-flight decision; return its action (None if it was not tracked)."""
        entry = self.in_flight.pop(decision_id, None)
        return entry[0] if entry is not None else None

    def mark_applied(self, action: str, tick: int, decision_id: str) -> None:
        """Start warm-ups of inhibitions that name `action`."""
        self.applied[action] = (tick, decision_id)

    def inhibition(self, kind: str, tick: int, entries: tuple[Inhibit, ...]) -> Inhibition | None:
        """The inhibition silencing `kind` at `tick`, if any."""
        for entry in entries:
            if kind not in entry.anomalies:
                continue
            for decision_id, (action, _t, _d) in self.in_flight.items():
                if action == entry.while_action:
                    return Inhibition(entry, decision_id, True)
            applied = self.applied.get(entry.while_action)
            # A warm-up ends warmup_steps ticks after the action was applied; an applied
            # tick further ahead than the warm-up itself (an absurd tick) holds nothing open.
            if (
                applied is not None
                and -entry.warmup_steps <= tick - applied[0] < entry.warmup_steps
            ):
                return Inhibition(entry, applied[1], False)
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "in_flight": [[i, a, t, d] for i, (a, t, d) in self.in_flight.items()],
            "applied": {a: [t, i] for a, (t, i) in self.applied.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Budget:
        """Rebuild from `to_dict` output."""
        budget = cls()
        for decision_id, action, tick, disruptive in data["in_flight"]:
            budget.in_flight[str(decision_id)] = (str(action), int(tick), bool(disruptive))
        for action, (tick, decision_id) in data["applied"].items():
            budget.applied[str(action)] = (int(tick), str(decision_id))
        return budget
