"""The two records that cross every boundary: anomaly events and decisions.

An `AnomalyEvent` is what a detector saw; a `Decision` is what the engine
chose to do about it. Both are plain frozen dataclasses with a dict form for
the wire and the journal. `AnomalyEvent.from_dict` is the one place where
untrusted input (a batch from a worker, a line from a test file) is checked:
it raises `EventError` with a message naming the bad field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from remedy.policies._vocab import ANOMALY_KINDS, SEVERITIES, SOURCES
from remedy.policies.exceptions import EventError


@dataclass(frozen=True, slots=True)
class AnomalyEvent:
    """One anomaly seen on one rank at one step.

    `step` is the logical training step (it goes back after a rollback);
    `tick` is the rank's count of executed steps, which only grows, so
    windows and cooldowns stay meaningful across rollbacks. It defaults to
    `step` where a source has no separate count.
    """

    kind: str
    rank: int
    step: int
    value: float | None = None
    threshold: float | None = None
    severity: str = "warning"
    source: str = "detector"
    ts: float = 0.0
    tick: int = -1
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tick < 0:
            object.__setattr__(self, "tick", self.step)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form used on the wire and in `anomalies.jsonl`."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "rank": self.rank,
            "step": self.step,
            "tick": self.tick,
            "value": _json_float(self.value),
            "threshold": _json_float(self.threshold),
            "severity": self.severity,
            "source": self.source,
            "ts": self.ts,
        }
        if self.details:
            out["details"] = dict(self.details)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> AnomalyEvent:
        """Validate untrusted input and build an event; raise `EventError` if malformed."""
        if not isinstance(data, Mapping):
            raise EventError(f"an event must be a mapping, got {type(data).__name__}")
        unknown = set(data) - _FIELDS
        if unknown:
            raise EventError(f"unknown event field(s): {', '.join(sorted(map(str, unknown)))}")
        kind = data.get("kind")
        if kind not in ANOMALY_KINDS:
            raise EventError(
                f"unknown anomaly kind {kind!r}; valid kinds: {', '.join(ANOMALY_KINDS)}"
            )
        rank = _required_int(data, "rank")
        step = _required_int(data, "step")
        tick = _int_field(data, "tick", required=False)
        severity = data.get("severity", "warning")
        if severity not in SEVERITIES:
            raise EventError(f"severity must be one of {', '.join(SEVERITIES)}, got {severity!r}")
        source = data.get("source", "detector")
        if source not in SOURCES:
            raise EventError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
        details = data.get("details", {})
        if not isinstance(details, Mapping):
            raise EventError("details must be a mapping")
        ts = data.get("ts", 0.0)
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise EventError(f"ts must be a number, got {ts!r}")
        return cls(
            kind=kind,
            rank=rank,
            step=step,
            value=_float_field(data, "value"),
            threshold=_float_field(data, "threshold"),
            severity=severity,
            source=source,
            ts=float(ts),
            tick=step if tick is None else tick,
            details=dict(details),
        )


_FIELDS = frozenset(
    {"kind", "rank", "step", "tick", "value", "threshold", "severity", "source", "ts", "details"}
)


@dataclass(frozen=True, slots=True)
class Decision:
    """One action the engine chose, with the sentence that explains why.

    A rule's `do` list yields one decision per step, sharing `chain_id` and
    numbered by `chain_index`. `suppressed` decisions record a match that a
    cooldown, budget or inhibition stopped; they are journaled, not carried
    out. `dry_run` decisions are journaled as such and not carried out.

    A failed decision ends its chain (a dispatcher must not carry out the
    later steps) unless `continue_on_failure` is set (the step says
    `on_failure: next`): then the later steps, already issued, go ahead.
    Use `ends_chain_on_failure` rather than testing the flag by hand.
    """

    decision_id: str
    step: int
    ranks: tuple[int, ...]
    rule: str
    anomaly: AnomalyEvent
    action: str
    params: Mapping[str, Any]
    reason: str
    chain_id: str = ""
    chain_index: int = 0
    chain_length: int = 1
    dry_run: bool = False
    suppressed: bool = False
    disruptive: bool = False
    continue_on_failure: bool = False

    @property
    def ends_chain_on_failure(self) -> bool:
        """True when a failure of this decision means its chain's later steps must not run."""
        return not self.continue_on_failure

    def to_dict(self) -> dict[str, Any]:
        """The journal form (the supervisor adds `ts`, `run_id` and `outcome`)."""
        return {
            "decision_id": self.decision_id,
            "step": self.step,
            "ranks": list(self.ranks),
            "rule": self.rule,
            "anomaly": self.anomaly.to_dict(),
            "action": self.action,
            "params": dict(self.params),
            "reason": self.reason,
            "chain_id": self.chain_id,
            "chain_index": self.chain_index,
            "chain_length": self.chain_length,
            "dry_run": self.dry_run,
            "suppressed": self.suppressed,
            "disruptive": self.disruptive,
            "continue_on_failure": self.continue_on_failure,
        }


def _int_field(data: Mapping[str, Any], name: str, *, required: bool) -> int | None:
    value = data.get(name)
    if value is None:
        if required:
            raise EventError(f"missing required event field {name!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EventError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _required_int(data: Mapping[str, Any], name: str) -> int:
    value = _int_field(data, name, required=True)
    assert value is not None  # _int_field raised otherwise
    return value


def _float_field(data: Mapping[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in _NONFINITE:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EventError(f"{name} must be a number or null, got {value!r}")
    return float(value)


_NONFINITE = frozenset({"nan", "inf", "-inf"})


def _json_float(value: float | None) -> float | str | None:
    """JSON has no NaN or inf; keep them readable as strings."""
    if value is None or math.isfinite(value):
        return value
    return str(value)
