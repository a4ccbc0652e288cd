"""The remedy policy language: load YAML policies, and run them over anomaly events.

Pure Python (no Ray, no torch): the same event stream always gives the same
decisions. See docs/policies.md for the language and docs/reference.md for every name in it.
Names here are loaded on first use: a rank takes the anomaly records without the
YAML loader and its models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remedy._lazy import exports

if TYPE_CHECKING:
    from remedy.policies._check import check_policy
    from remedy.policies._diagnostics import Diagnostic
    from remedy.policies._engine import Engine
    from remedy.policies._events import EVENT_REJECT_REASONS, MAX_STEP, AnomalyEvent, Decision
    from remedy.policies._incidents import IncidentMerger, merged_text
    from remedy.policies._limits import MAX_DEPTH, MAX_POLICY_BYTES
    from remedy.policies._loader import (
        bundled_policy_path,
        load_policy,
        load_policy_bytes,
        load_policy_text,
    )
    from remedy.policies._notify import SINK_KINDS, NotifySink
    from remedy.policies._rules import Policy, Rule, Step
    from remedy.policies._vocab import (
        ACTIONS,
        ANOMALY_KINDS,
        DISRUPTIVE_ACTIONS,
        OUTCOMES,
        SEVERITIES,
        SOURCES,
        SUPERVISOR_ACTIONS,
        severity_rank,
    )
    from remedy.policies.exceptions import (
        EventError,
        OutcomeError,
        PolicyError,
        PolicyPackageError,
        PolicyTestError,
        StateError,
    )

_EXPORTS = {
    "ACTIONS": "remedy.policies._vocab",
    "ANOMALY_KINDS": "remedy.policies._vocab",
    "AnomalyEvent": "remedy.policies._events",
    "DISRUPTIVE_ACTIONS": "remedy.policies._vocab",
    "Decision": "remedy.policies._events",
    "Diagnostic": "remedy.policies._diagnostics",
    "EVENT_REJECT_REASONS": "remedy.policies._events",
    "Engine": "remedy.policies._engine",
    "EventError": "remedy.policies.exceptions",
    "IncidentMerger": "remedy.policies._incidents",
    "MAX_DEPTH": "remedy.policies._limits",
    "MAX_POLICY_BYTES": "remedy.policies._limits",
    "MAX_STEP": "remedy.policies._events",
    "NotifySink": "remedy.policies._notify",
    "OUTCOMES": "remedy.policies._vocab",
    "OutcomeError": "remedy.policies.exceptions",
    "Policy": "remedy.policies._rules",
    "PolicyError": "remedy.policies.exceptions",
    "PolicyPackageError": "remedy.policies.exceptions",
    "PolicyTestError": "remedy.policies.exceptions",
    "Rule": "remedy.policies._rules",
    "SEVERITIES": "remedy.policies._vocab",
    "SINK_KINDS": "remedy.policies._notify",
    "SOURCES": "remedy.policies._vocab",
    "SUPERVISOR_ACTIONS": "remedy.policies._vocab",
    "StateError": "remedy.policies.exceptions",
    "Step": "remedy.policies._rules",
    "bundled_policy_path": "remedy.policies._loader",
    "check_policy": "remedy.policies._check",
    "load_policy": "remedy.policies._loader",
    "load_policy_bytes": "remedy.policies._loader",
    "load_policy_text": "remedy.policies._loader",
    "merged_text": "remedy.policies._incidents",
    "severity_rank": "remedy.policies._vocab",
}

__all__ = [
    "ACTIONS",
    "ANOMALY_KINDS",
    "DISRUPTIVE_ACTIONS",
    "EVENT_REJECT_REASONS",
    "MAX_DEPTH",
    "MAX_POLICY_BYTES",
    "MAX_STEP",
    "OUTCOMES",
    "SEVERITIES",
    "SINK_KINDS",
    "SOURCES",
    "SUPERVISOR_ACTIONS",
    "AnomalyEvent",
    "Decision",
    "Diagnostic",
    "Engine",
    "EventError",
    "IncidentMerger",
    "NotifySink",
    "OutcomeError",
    "Policy",
    "PolicyError",
    "PolicyPackageError",
    "PolicyTestError",
    "Rule",
    "StateError",
    "Step",
    "bundled_policy_path",
    "check_policy",
    "load_policy",
    "load_policy_bytes",
    "load_policy_text",
    "merged_text",
    "severity_rank",
]

__getattr__, __dir__ = exports("remedy.policies", _EXPORTS, globals())
