"""Effects the decision core asks its shell to carry out.

The Controller decides; whoever runs it (the supervisor actor, or a Guard
alone) takes its effects (`Controller.take_effects`), carries them out in
order and, where one needs an answer, says how it went with an input:
`Notify` is a person to be told (a shell sends it on, a webhook, an alert
manager, and answers `resolve_notify`; without one the Controller logs it:
`log_notify`); `GroupAction` a group action on the ranks the shell owns
(answered `resolve_group_action`).

The core writes no file itself. What it journals leaves as `Journal`
effects, which the shell carries out in the order they were emitted, before
it writes a state record or replies (`rundir.journal_effects` writes them into
a run directory):

- `HistoryRecord`: one line of `history.jsonl`, what the supervisor did (a
  decision taken, one resolved); what a crash must not lose is in the state
  records the shell writes before a reply carries a command;
- `DecisionRecord`: one line of `decisions.jsonl` (a decision with its outcome);
- `AnomalyRecord`: one line of `anomalies.jsonl`;
- `MetricRecords`: the step records of one report, for `metrics.jsonl`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from remedy.policies import Decision

log = structlog.get_logger("remedy.control")


@dataclass(frozen=True, slots=True)
class Notify:
    """Tell a person: the decision it comes from, its rule, its reason and its message."""

    decision_id: str
    rule: str
    reason: str
    message: str | None
    # The whole decision, for a sink whose message names its ranks, anomaly and step.
    decision: Decision | None = field(default=None, compare=False)


def log_notify(effect: Notify) -> tuple[str, str]:
    """The default sink: one log line; (outcome, detail) as a shell's answer gives them."""
    node = effect.decision.anomaly.node if effect.decision is not None else None
    log.warning("notify", rule=effect.rule, reason=effect.reason, message=effect.message, node=node)
    return "applied", "notification logged"


@dataclass(frozen=True, slots=True)
class HistoryRecord:
    """Append `record` to the run's history (`history.jsonl`)."""

    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """Append a decision with its outcome to `decisions.jsonl`."""

    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class AnomalyRecord:
    """Append an anomaly to `anomalies.jsonl`."""

    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class MetricRecords:
    """Append one report's step records to `metrics.jsonl`."""

    records: list[dict[str, Any]]


Journal = HistoryRecord | DecisionRecord | AnomalyRecord | MetricRecords


@dataclass(frozen=True, slots=True)
class GroupAction:
    """Carry out a group action (restart_rank) on the ranks the shell owns; it answers with
    `Controller.resolve_group_action` once it ended (at once, or after a restart)."""

    decision: Decision


# Everything the Controller asks of its shell (`Controller.take_effects`).
Effect = Journal | Notify | GroupAction
