"""A run's health at its end: `completed` with a rank that stopped learning becomes `degraded`
with the reason; every other status stands; the report headline says both, and the steps asked."""

from __future__ import annotations

from typing import Any

import pytest

from remedy.control.health import degraded_reason, final_status
from remedy.rundir.headline import status_words, steps_words

SICK = "no learning in the last 20 steps: the gradients were identically zero"


def rank(n: int, tail: str | None, **extra: Any) -> dict[str, Any]:
    return {"rank": n, "status": "completed", "learning": {"unhealthy_tail": tail}, **extra}


def test_a_healthy_run_stays_completed() -> None:
    """Every rank learned to the end: completed, no reason."""
    assert final_status("completed", [rank(0, None), rank(1, None)]) == ("completed", None)


def test_a_rank_that_stopped_learning_degrades_the_run() -> None:
    """One rank's unhealthy tail: degraded, naming the rank and why."""
    status, why = final_status("completed", [rank(1, SICK), rank(0, None)])
    assert status == "degraded"
    assert why == f"rank 1: {SICK}"


@pytest.mark.parametrize("status", ["aborted", "failed", "stopped"])
def test_other_statuses_stand(status: str) -> None:
    """A run that ended badly already says so: its status is kept, with no degraded reason."""
    assert final_status(status, [rank(0, SICK)]) == (status, None)


def test_ranks_without_learning_counts_are_healthy() -> None:
    """A rank summary of an older version (no `learning`) is not a reason."""
    assert degraded_reason([{"rank": 0, "status": "completed"}]) is None


def test_headline_words() -> None:
    """The headline says degraded with its reason, and 207 of 300 asked steps."""
    summary = {
        "status": "degraded",
        "degraded_reason": f"rank 0: {SICK}",
        "steps_completed": 207,
        "steps_executed": 300,
        "ranks": [rank(0, SICK, steps_asked=300, short_of_asked="trained 207 of the 300")],
    }
    assert status_words(summary) == f"degraded (rank 0: {SICK})"
    assert steps_words(summary) == "207 of 300 asked steps, 300 executed"
    plain = {"status": "completed", "steps_completed": 300, "steps_executed": 310, "ranks": []}
    assert (status_words(plain), steps_words(plain)) == ("completed", "300 steps, 310 executed")
