"""Effects the decision core asks its shell to carry out.

The Controller decides; whoever runs it (the supervisor actor, or a Guard
alone) carries the effect out and says how it went. `Notify` is a person
to be told: the default sink logs it; a shell may send it on (a webhook, an
alert manager) and return what happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
