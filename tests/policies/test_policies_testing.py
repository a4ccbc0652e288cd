"""Public test helpers: stream(), run_stream(), assert_decisions()."""

from __future__ import annotations

import pytest

from remedy.policies import load_policy
from remedy.policies.testing import actions_by_step, assert_decisions, batches, run_stream, stream


@pytest.mark.timeout(10)
def test_stream_builds_events_per_step_and_rank() -> None:
    """stream() makes one event per rank at each non-blank step, with values and ts."""
    events = stream("loss_spike", "_x2 5.0e4 _ nan", ranks=[1, 0], step_seconds=2.0)
    assert [(e.step, e.rank) for e in events] == [(3, 0), (3, 1), (5, 0), (5, 1)]
    assert events[0].value == 5.0e4
    assert events[0].ts == 6.0
    assert events[0].tick == 3


@pytest.mark.timeout(10)
def test_batches_group_by_tick() -> None:
    """batches() yields one list per tick in order."""
    events = stream("oom", "1 _ 1") + stream("oom", "1", ranks=[3])
    assert [[e.rank for e in b] for b in batches(events)] == [[0, 3], [0]]


@pytest.mark.timeout(10)
def test_run_stream_with_bundled_policy_name() -> None:
    """run_stream accepts a bundled name and auto-applies decisions."""
    decisions = run_stream("default", stream("nonfinite_loss", "_x149 1", ranks=range(4)))
    assert_decisions(decisions, {150: ["rollback", "shrink_lr"]})


@pytest.mark.timeout(10)
def test_run_stream_without_auto_apply_keeps_budget_busy() -> None:
    """With auto_apply=False the rollback stays in flight and blocks the next one."""
    events = stream("nonfinite_loss", "1 _x30 1")
    decisions = run_stream(load_policy("default"), events, auto_apply=False)
    assert actions_by_step(decisions) == {1: ["rollback", "shrink_lr"]}
    assert actions_by_step(decisions, suppressed=True) == {32: ["rollback"]}


@pytest.mark.timeout(10)
def test_assert_decisions_shows_a_diff() -> None:
    """assert_decisions raises with expected and got per step."""
    decisions = run_stream("default", stream("loss_spike", "_x9 9.0"))
    with pytest.raises(AssertionError, match=r"step 10: expected \['notify'\], got \['rollback'\]"):
        assert_decisions(decisions, {10: ["notify"]})
    assert_decisions(decisions, {10: ["rollback"]})
    assert_decisions(decisions, {}, exhaustive=False)
