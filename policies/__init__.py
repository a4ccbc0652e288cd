"""The remedy policy language: load YAML policies, and run them over anomaly events.

Pure Python (no Ray, no torch): the same event stream always gives the same
decisions. See docs/policies.md for the language and docs/reference.md for every name in it.
"""

from __future__ import annotations

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
