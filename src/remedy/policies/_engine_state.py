"""Saving and restoring an engine's state (`Engine.state_dict` / `load_state_dict`).

A restarted supervisor must neither forget a cooldown nor lose track of an
in-flight rollback, so everything the engine counts is written as plain
JSON: the decision sequence number, the clock, each rule's counters (by
rule name, so a state restores into a reloaded policy), the budget and the
decisions waiting for an outcome.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from remedy.policies._budget import Budget
from remedy.policies._events import AnomalyEvent
from remedy.policies._ladder import Ladder
from remedy.policies._occurrence import Occurrence, Pending
from remedy.policies._rules import Escalation
from remedy.policies._rulestate import RuleState
from remedy.policies.exceptions import EventError, StateError

if TYPE_CHECKING:
    from remedy.policies._engine import Engine

FORMAT = 1


def dump_state(engine: Engine) -> dict[str, Any]:
    """The JSON-able state of `engine`."""
    return {
        "format": FORMAT,
        "run_id": engine.run_id,
        "policy": engine.policy.name,
        "seq": engine._seq,
        "tick": engine._tick,
        "ts": engine._ts,
        "rules": {name: state.to_dict() for name, state in engine._states.items()},
        "budget": engine._budget.to_dict(),
        "pending": [_pending_to_dict(i, p) for i, p in engine._pending.items()],
        "ladder": engine._ladder.to_dict(),
    }


def load_state(engine: Engine, data: dict[str, Any]) -> None:
    """Restore `engine` from `dump_state` output; raise `StateError` if it is malformed."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise StateError(f"not an engine state of format {FORMAT}")
    try:
        states = dict(engine._states)
        for name, raw in data["rules"].items():
            rule = engine.policy.rule(name)
            if rule is not None:
                states[name] = RuleState.from_dict(rule, raw)
        budget = Budget.from_dict(data["budget"])
        pending: OrderedDict[str, Pending] = OrderedDict()
        for raw in data["pending"]:
            occ = Occurrence(
                AnomalyEvent.from_dict(raw["event"]),
                tuple(int(r) for r in raw["ranks"]),
                int(raw["tick"]),
                float(raw["ts"]),
            )
            pending[str(raw["id"])] = _pending(raw, occ)
        seq, tick, ts = int(data["seq"]), int(data["tick"]), float(data["ts"])
        # A state from before the escalation ladder has none: no incident tracked.
        ladder = Ladder.from_dict(data.get("ladder"))
    except (
        KeyError,
        TypeError,
        ValueError,
        IndexError,
        AttributeError,
        OverflowError,
        EventError,
    ) as exc:
        raise StateError(f"malformed engine state: {exc!r}") from None
    engine._states, engine._budget, engine._pending = states, budget, pending
    engine._seq, engine._tick, engine._ts = seq, tick, ts
    engine._ladder = ladder


def _pending_to_dict(decision_id: str, p: Pending) -> dict[str, Any]:
    return {
        "id": decision_id,
        "rule": p.rule,
        "chain_id": p.chain_id,
        "chain_index": p.chain_index,
        "chain_length": p.chain_length,
        "action": p.action,
        "event": p.occurrence.event.to_dict(),
        "ranks": list(p.occurrence.ranks),
        "tick": p.occurrence.tick,
        "ts": p.occurrence.ts,
        "on_failure": p.on_failure.to_json() if p.on_failure is not None else None,
    }


def _pending(raw: dict[str, Any], occ: Occurrence) -> Pending:
    return Pending(
        str(raw["rule"]),
        str(raw["chain_id"]),
        int(raw["chain_index"]),
        int(raw["chain_length"]),
        str(raw["action"]),
        occ,
        _escalation(raw["on_failure"]),
    )


def _escalation(raw: Any) -> Escalation | None:
    if raw is None:
        return None
    if isinstance(raw, dict):
        return Escalation("rule", str(raw["rule"]))
    if raw in ("next", "abort", "notify"):
        return Escalation(raw)
    raise ValueError(f"unknown on_failure {raw!r}")
