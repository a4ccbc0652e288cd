"""Small records the engine passes around: an occurrence, and a decision awaiting its outcome."""

from __future__ import annotations

from dataclasses import dataclass

from remedy.policies._events import AnomalyEvent
from remedy.policies._rules import Escalation


@dataclass(frozen=True, slots=True)
class Occurrence:
    """One group of events a rule acts on, with the moment it is judged at."""

    event: AnomalyEvent  # the representative: the worst severity, first in the batch
    ranks: tuple[int, ...]
    tick: int
    ts: float


@dataclass(frozen=True, slots=True)
class Pending:
    """What the engine remembers about an issued decision until its outcome arrives."""

    rule: str
    chain_id: str
    chain_index: int
    chain_length: int
    action: str
    occurrence: Occurrence
    on_failure: Escalation | None
