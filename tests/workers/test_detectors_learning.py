"""The learning tracker and `learning_stopped`: steps that learned nothing are counted by cause;
20 in a row fire, again every 20 while it lasts; one step that learns ends the streak."""

from __future__ import annotations

import pytest

from remedy.rank.detectors import LearningDetector
from remedy.rank.detectors.testing import step_stats
from remedy.rank.loop.learning import LearningTracker, step_cause


@pytest.mark.parametrize(
    ("fields", "cause"),
    [
        ({}, None),
        ({"optimizer_skipped": True}, "skipped"),
        ({"grad_norm": 0.0}, "zero_grad"),
        ({"loss_scale": 0.25}, "scale_floor"),
        ({"loss_scale": 1024.0}, None),
    ],
)
def test_step_cause(fields: dict[str, object], cause: str | None) -> None:
    """Why one step learned nothing, or None."""
    assert step_cause(step_stats(0, **fields)) == cause


def test_tracker_counts_and_tail() -> None:
    """Counts by cause over the run; the tail is unhealthy only when all its steps were."""
    t = LearningTracker(tail_steps=5)
    for i in range(10):
        t.observe(step_stats(i))
    for i in range(10, 14):
        t.observe(step_stats(i, grad_norm=0.0))
    assert t.tail_reason() is None, "one of the last 5 steps learned"
    t.observe(step_stats(14, optimizer_skipped=True))
    s = t.summary()
    assert (s["updates_applied"], s["updates_skipped"], s["zero_grad_steps"]) == (14, 1, 4)
    assert s["unhealthy_tail"] == (
        "no learning in the last 5 steps: every update was skipped (overflow, non-finite or "
        "out-of-memory steps); the gradients were identically zero"
    )


def test_learning_stopped_fires_every_patience_steps() -> None:
    """Zero gradients from step 5: fires at the 20th and 40th such step, critical, cause zero_grad."""
    d = LearningDetector(patience=20)
    fired = []
    for i in range(50):
        for e in d.observe(step_stats(i, grad_norm=0.0 if i >= 5 else 1.0)):
            fired.append((e.step, e.severity, e.details["cause"]))
    assert fired == [(24, "critical", "zero_grad"), (44, "critical", "zero_grad")]


def test_one_learning_step_or_a_rollback_ends_the_streak() -> None:
    """A step that learned, or a rollback (reset), starts the count again."""
    d = LearningDetector(patience=3)
    assert [
        e.step for i in range(2) for e in d.observe(step_stats(i, optimizer_skipped=True))
    ] == []
    d.observe(step_stats(2))
    d.observe(step_stats(3, optimizer_skipped=True))
    d.reset()
    got = [e.step for i in range(4, 7) for e in d.observe(step_stats(i, optimizer_skipped=True))]
    assert got == [6]


def test_an_update_skipped_on_a_commands_order_learned_nothing_wrong() -> None:
    """A callback's `skip_batches` drops updates on purpose (`extra["skipped_batch"]`): not a
    cause, and it ends a streak."""
    assert step_cause(step_stats(0, optimizer_skipped=True, extra={"skipped_batch": True})) is None
