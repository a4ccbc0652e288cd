"""Errors raised by the policy package; all derive from `PolicyPackageError`.

They cross Ray actor boundaries (a supervisor loading a policy for a worker,
a worker reporting a bad event), so each one pickles with its data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from remedy.policies._diagnostics import Diagnostic


class PolicyPackageError(Exception):
    """Base class for every error the policies package raises."""


class EventError(PolicyPackageError, ValueError):
    """An anomaly event failed validation (a malformed event from a worker or a test).

    `reason` is a short machine-readable name for what was wrong, for counting
    rejections: ``not_a_mapping``, ``unknown_field``, ``unknown_kind``,
    ``bad_rank``, ``bad_step``, ``bad_tick``, ``bad_value``, ``bad_threshold``,
    ``bad_severity``, ``bad_source``, ``bad_ts`` or ``bad_details``
    (`remedy.policies.EVENT_REJECT_REASONS`); ``invalid`` when not given.
    """

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[type[EventError], tuple[str, str]]:
        return (type(self), (str(self), self.reason))


class PolicyError(PolicyPackageError, ValueError):
    """A policy file is malformed or invalid.

    `diagnostics` holds every problem found (not just the first), each with
    the file, line and column to fix; `str(err)` is one
    ``FILE:LINE:COL: error: message`` line per diagnostic.
    """

    def __init__(self, diagnostics: Sequence[Diagnostic]) -> None:
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        super().__init__("\n".join(d.format() for d in self.diagnostics))

    def __reduce__(self) -> tuple[type[PolicyError], tuple[list[Diagnostic]]]:
        return (type(self), (self.diagnostics,))


class OutcomeError(PolicyPackageError, ValueError):
    """`Engine.record_outcome` was given an outcome it does not know."""

    def __reduce__(self) -> tuple[type[OutcomeError], tuple[str]]:
        return (type(self), (str(self),))


class StateError(PolicyPackageError, ValueError):
    """`Engine.load_state_dict` was given a state it cannot restore."""

    def __reduce__(self) -> tuple[type[StateError], tuple[str]]:
        return (type(self), (str(self),))


class PolicyTestError(PolicyPackageError, ValueError):
    """A policy test file is malformed (not a failing test: a file that cannot run)."""

    def __reduce__(self) -> tuple[type[PolicyTestError], tuple[str]]:
        return (type(self), (str(self),))
