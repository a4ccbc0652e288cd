"""Effects the decision core asks its shell to carry out.

The Controller decides; whoever runs it (the supervisor actor, or a Guard
alone) carries the effect out and says how it went. `Notify` is a person
to be told: the default sink logs it; a shell may send it on (a webhook, an
alert manager) and return what happened.

The core writes no file itself. What it journals leaves as `Journal`
effects, carried out in the order they are emitted and before the call
that emitted them returns (`journal_to` writes them into a run directory):

- `HistoryRecord`: one line of `history.jsonl`, what the supervisor did (a
  decision taken, one resolved); what a crash must not lose is in the state
  records the shell writes before a reply carries a command;
- `DecisionRecord`: one line of `decisions.jsonl` (a decision with its outcome);
- `AnomalyRecord`: one line of `anomalies.jsonl`;
- `MetricRecords`: the step records of one report, for `metrics.jsonl`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

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


# Carries a `Notify` out; returns (outcome, detail): ("applied", "notification logged").
NotifyCarrier = Callable[[Notify], tuple[str, str]]


def log_notify(effect: Notify) -> tuple[str, str]:
    """The default sink: one log line."""
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
# Carries out one `Journal` effect before returning.
JournalCarrier = Callable[[Journal], None]


class JournalFiles(Protocol):
    """The journals of a run directory (`workers.rundir.RunDir`)."""

    def history(self, record: dict[str, Any]) -> None: ...
    def decision(self, record: dict[str, Any]) -> None: ...
    def anomaly(self, record: dict[str, Any]) -> None: ...
    def metrics_many(self, records: list[dict[str, Any]]) -> None: ...


def journal_to(files: JournalFiles) -> JournalCarrier:
    """A carrier that writes each `Journal` effect into `files`, in the order emitted."""

    def carry(effect: Journal) -> None:
        match effect:
            case HistoryRecord(record):
                files.history(record)
            case DecisionRecord(record):
                files.decision(record)
            case AnomalyRecord(record):
                files.anomaly(record)
            case MetricRecords(records):
                files.metrics_many(records)

    return carry
