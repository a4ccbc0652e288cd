"""The decisions journaled: one `decisions.jsonl` line per decision, with its outcome.

A decision is journaled once, when it ends (`journal`): kept in the
Controller's `decisions` with the counts of the summary, and handed to the
shell as a `DecisionRecord` effect. A restarted supervisor takes the lines
written before it back (`restore_decisions`): an outcome re-sent after the
restart resolves its decision again, and must not journal it twice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from remedy.control.effects import DecisionRecord
from remedy.policies import Decision

if TYPE_CHECKING:
    from remedy.control.decide import Controller


def journal(c: Controller, d: Decision, outcome: str, *, detail: str = "", **extra: Any) -> None:
    """Journal decision `d` with its `outcome` (once: a line written before a restart stands)."""
    record = decision_record(d, outcome, detail=detail, **extra)
    if d.decision_id in c._journaled:
        return  # journaled before a supervisor restart; its outcome came again
    c._journaled.add(d.decision_id)
    c.changes += 1
    c.decisions.append(record)
    c.outcome_counts[outcome] += 1
    if outcome == "applied":
        c.action_counts[d.action] += 1
    c._emit(DecisionRecord(record))


def restore_decisions(c: Controller, records: Iterable[dict[str, Any]]) -> None:
    """The lines of decisions.jsonl written before a restart: kept, and never written again.

    The outcome and action counts are the journal's, recounted from these lines
    (a line written after the last state record counts too).
    """
    c.outcome_counts, c.action_counts = Counter(), Counter()
    for record in records:
        decision_id = record.get("decision_id")
        if not isinstance(decision_id, str) or decision_id in c._journaled:
            continue
        c._journaled.add(decision_id)
        c.decisions.append(record)
        outcome = str(record.get("outcome"))
        c.outcome_counts[outcome] += 1
        if outcome == "applied":
            c.action_counts[str(record.get("action"))] += 1


def decision_record(d: Decision, outcome: str, *, detail: str = "", **extra: Any) -> dict[str, Any]:
    """The `decisions.jsonl` line of decision `d` with its `outcome`."""
    return {
        "decision_id": d.decision_id,
        "step": d.step,
        "ranks": list(d.ranks),
        "rule": d.rule,
        "anomaly": d.anomaly.to_dict(),
        "action": d.action,
        "params": dict(d.params),
        "outcome": outcome,
        "reason": d.reason,
        "detail": detail,
        "chain": {"id": d.chain_id, "index": d.chain_index, "length": d.chain_length},
        **extra,
    }
