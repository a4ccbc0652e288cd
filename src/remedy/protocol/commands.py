"""Commands: decisions turned into instructions a rank applies at a step boundary.

The supervisor (or the single-process controller) assigns each in-process
decision an `apply_at_step`; every rank applies the same command at the
first step boundary at or after it, so data-parallel replicas change
together. Commands and their outcomes travel as plain dicts.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

from remedy.policies import Decision


@dataclass(frozen=True, slots=True)
class Command:
    """One action for the ranks, identified by the decision it carries out."""

    decision_id: str
    action: str
    params: dict[str, Any]
    apply_at_step: int
    anomaly_step: int
    # Ranks apply a command at the first boundary whose tick (executed-step
    # count) reaches this; ticks never go back, so a rollback earlier in the
    # same chain cannot postpone the steps after it.
    apply_at_tick: int = 0
    # Dispatch order, from 1. Ranks of a process group agree on the highest
    # sequence number all of them hold and apply up to it at the same boundary.
    seq: int = 0
    chain_id: str = ""
    chain_index: int = 0
    # `on_failure: next`: a failure of this command does not stop the later steps.
    continue_on_failure: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Command:
        return cls(**data)

    @classmethod
    def from_decision(
        cls, decision: Decision, *, apply_at_step: int, apply_at_tick: int, seq: int = 0
    ) -> Command:
        return cls(
            decision_id=decision.decision_id,
            action=decision.action,
            params=dict(decision.params),
            apply_at_step=apply_at_step,
            apply_at_tick=apply_at_tick,
            seq=seq,
            anomaly_step=decision.anomaly.step,
            chain_id=decision.chain_id,
            chain_index=decision.chain_index,
            continue_on_failure=decision.continue_on_failure,
        )


@dataclass(slots=True)
class Outcome:
    """What a rank reports after trying a command."""

    decision_id: str
    rank: int
    outcome: str  # "applied" | "failed"
    step: int
    tick: int
    detail: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    attempts: int = 1

    def to_dict(self) -> dict[str, Any]:
        # Written out field by field: `asdict` deep-copies through its generic walk, and a state
        # record at thousands of ranks turns every pending command's outcomes into dicts.
        return {
            "decision_id": self.decision_id,
            "rank": self.rank,
            "outcome": self.outcome,
            "step": self.step,
            "tick": self.tick,
            "detail": self.detail,
            "result": copy.deepcopy(self.result) if self.result else {},
            "attempts": self.attempts,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        return cls(**data)
