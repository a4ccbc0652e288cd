"""The words at the top of a run's summary: its status with the reason, and its steps.

Shared by `remedy run`'s closing lines, `remedy report`'s page and its
figure, so each says the same: `degraded (rank 0: no learning in the last
20 steps: ...)`, and `207 of 300 asked steps` where a framework's run was
shortened by rollbacks (its `max_steps` counts executed steps).
"""

from __future__ import annotations

from typing import Any


def status_words(summary: dict[str, Any]) -> str:
    """The status, with why the run is degraded when it is."""
    status = str(summary.get("status"))
    why = summary.get("degraded_reason")
    return f"{status} ({why})" if status == "degraded" and why else status


def steps_asked(summary: dict[str, Any]) -> int | None:
    """The logical steps a framework was asked for, when a rank trained fewer (else None)."""
    for rank in summary.get("ranks") or []:
        if isinstance(rank, dict) and rank.get("short_of_asked") and rank.get("steps_asked"):
            return int(rank["steps_asked"])
    return None


def steps_words(summary: dict[str, Any]) -> str:
    """`207 of 300 asked steps, 300 executed`, or `300 steps, 310 executed`."""
    done, executed = summary.get("steps_completed"), summary.get("steps_executed")
    asked = steps_asked(summary)
    kept = f"{done} of {asked} asked steps" if asked is not None else f"{done} steps"
    return f"{kept}, {executed} executed"
