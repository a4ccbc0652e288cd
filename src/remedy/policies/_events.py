"""The two records that cross every boundary: anomaly events and decisions.

An `AnomalyEvent` is what a detector saw; a `Decision` is what the engine
chose to do about it. Both are plain frozen dataclasses with a dict form for
the wire and the journal. `AnomalyEvent.from_dict` is the one place where
untrusted input (a batch from a worker, a line from a test file) is checked:
it raises `EventError` with a message naming the bad field.
"""

from __future__ import annotations

import json
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

    @property
    def node(self) -> str | None:
        """The node the rank ran on, when the supervisor stamped it (`details["node"]`).

        What `group_by: [node]` counts by: a node whose chips keep failing is one
        key, whichever of its ranks (or their replacements there) saw the fault.
        """
        node = self.details.get("node")
        return node if isinstance(node, str) else None

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
        """Validate untrusted input and build an event; raise `EventError` if malformed.

        Whatever `data` is, the only exception is `EventError`, whose `reason`
        names the first bad field (see `EVENT_REJECT_REASONS`).
        """
        if not isinstance(data, Mapping):
            raise EventError(f"an event must be a mapping, got {_kind_of(data)}", "not_a_mapping")
        try:
            keys = list(data.keys())
        except Exception:  # a hostile Mapping subclass; nothing else can leak from here
            raise EventError("an event's keys cannot be read", "not_a_mapping") from None
        unknown = [k for k in keys if not isinstance(k, str) or k not in _FIELDS]
        if unknown:
            names = ", ".join(sorted(_short(k) for k in unknown[:5]))
            raise EventError(f"unknown event field(s): {names}", "unknown_field")
        kind = data.get("kind")
        if not isinstance(kind, str) or kind not in _KIND_SET:
            raise EventError(
                f"unknown anomaly kind {_short(kind)}; valid kinds: {', '.join(ANOMALY_KINDS)}",
                "unknown_kind",
            )
        rank = _count(data, "rank", MAX_RANK, "bad_rank", required=True)
        step = _count(data, "step", MAX_STEP, "bad_step", required=True)
        tick = _count(data, "tick", MAX_STEP, "bad_tick", required=False)
        severity = data.get("severity", "warning")
        if not isinstance(severity, str) or severity not in SEVERITIES:
            raise EventError(
                f"severity must be one of {', '.join(SEVERITIES)}, got {_short(severity)}",
                "bad_severity",
            )
        source = data.get("source", "detector")
        if not isinstance(source, str) or source not in SOURCES:
            raise EventError(
                f"source must be one of {', '.join(SOURCES)}, got {_short(source)}", "bad_source"
            )
        ts = _number(data, "ts", "bad_ts")
        if ts is None or not math.isfinite(ts) or ts < 0:
            raise EventError(
                f"ts must be a finite number >= 0, got {_short(data.get('ts'))}", "bad_ts"
            )
        return cls(
            kind=kind,
            rank=rank,
            step=step,
            value=_number(data, "value", "bad_value"),
            threshold=_number(data, "threshold", "bad_threshold"),
            severity=severity,
            source=source,
            ts=ts,
            tick=step if tick is None else tick,
            details=_details(data.get("details")),
        )


# The largest step, tick and rank an event may carry: 2**53 - 1 is the largest
# integer JSON carries exactly; no run has more ranks than MAX_RANK.
MAX_STEP = 2**53 - 1
MAX_RANK = 2**20
MAX_DETAILS_BYTES = 4096
EVENT_REJECT_REASONS = (
    "not_a_mapping",
    "unknown_field",
    "unknown_kind",
    "bad_rank",
    "bad_step",
    "bad_tick",
    "bad_value",
    "bad_threshold",
    "bad_severity",
    "bad_source",
    "bad_ts",
    "bad_details",
)
_KIND_SET = frozenset(ANOMALY_KINDS)


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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        """Rebuild a decision from `to_dict` output (a journal record the supervisor wrote).

        Raises `EventError` for a malformed anomaly and `KeyError`/`TypeError`/
        `ValueError` for a malformed decision: the journal is trusted input,
        but a torn record must not pass for a good one.
        """
        return cls(
            decision_id=str(data["decision_id"]),
            step=int(data["step"]),
            ranks=tuple(int(r) for r in data["ranks"]),
            rule=str(data["rule"]),
            anomaly=AnomalyEvent.from_dict(data["anomaly"]),
            action=str(data["action"]),
            params=dict(data["params"]),
            reason=str(data["reason"]),
            chain_id=str(data.get("chain_id", "")),
            chain_index=int(data.get("chain_index", 0)),
            chain_length=int(data.get("chain_length", 1)),
            dry_run=bool(data.get("dry_run", False)),
            suppressed=bool(data.get("suppressed", False)),
            disruptive=bool(data.get("disruptive", False)),
            continue_on_failure=bool(data.get("continue_on_failure", False)),
        )


def _short(value: Any) -> str:
    """A bounded repr for error messages (input may be huge)."""
    try:
        text = repr(value) if isinstance(value, str | int | float | bool | None) else None
    except ValueError:  # an int too long to print
        text = None
    if text is None:
        return f"<{_kind_of(value)}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _kind_of(value: Any) -> str:
    return type(value).__name__


def _count(data: Mapping[str, Any], name: str, limit: int, reason: str, *, required: bool) -> Any:
    """A non-negative integer field no larger than `limit` (bools are not integers)."""
    value = data.get(name)
    if value is None:
        if required:
            raise EventError(f"missing required event field {name!r}", reason)
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise EventError(
            f"{name} must be an integer from 0 to {limit}, got {_short(value)}", reason
        )
    return int(value)


def _number(data: Mapping[str, Any], name: str, reason: str) -> float | None:
    """A number (int, float, or "nan"/"inf"/"-inf") as a float; None when absent."""
    value = data.get(name)
    if value is None:
        return 0.0 if name == "ts" else None
    if isinstance(value, str) and value.lower() in _NONFINITE:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EventError(f"{name} must be a number or null, got {_short(value)}", reason)
    try:
        return float(value)
    except OverflowError:
        raise EventError(f"{name} is too large for a float: {_short(value)}", reason) from None


def _details(value: Any) -> dict[str, Any]:
    """A small JSON-able mapping of extra facts; anything else is rejected."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise EventError(f"details must be a mapping, got {_kind_of(value)}", "bad_details")
    try:
        copied = dict(value)
        if not all(isinstance(k, str) for k in copied):
            raise TypeError("keys")
        text = json.dumps(copied)
    except (TypeError, ValueError, OverflowError, RecursionError):
        raise EventError("details must hold JSON values with string keys", "bad_details") from None
    if len(text) > MAX_DETAILS_BYTES:
        raise EventError(
            f"details are {len(text)} bytes as JSON, more than {MAX_DETAILS_BYTES}", "bad_details"
        )
    return copied


_NONFINITE = frozenset({"nan", "inf", "-inf"})


def _json_float(value: float | None) -> float | str | None:
    """JSON has no NaN or inf; keep them readable as strings."""
    if value is None or math.isfinite(value):
        return value
    return str(value)
