"""Counting and time: count/within, persist, cooldowns in steps and durations, back-off."""

from __future__ import annotations

import pytest

from remedy.policies import AnomalyEvent, Engine, load_policy_text
from remedy.policies._rules import Policy
from remedy.policies.testing import actions_by_step, run_stream, stream


def _policy(rule_body: str) -> Policy:
    return load_policy_text(
        "version: 1\nrules:\n  - name: r\n    when: {anomaly: loss_spike}\n"
        "    do: [skip_batches: {count: 5}]\n" + rule_body
    )


def _fired_steps(policy: Policy, pattern: str, **kw: float) -> list[int]:
    return sorted(actions_by_step(run_stream(policy, stream("loss_spike", pattern, **kw))))  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_count_within_steps() -> None:
    """count: 3 within 10 fires on the third occurrence inside the window only."""
    policy = _policy("    count: 3\n    within: 10\n")
    assert _fired_steps(policy, "1 _x10 1 _x3 1 _x3 1") == [20]


@pytest.mark.timeout(10)
def test_count_consumes_occurrences_on_firing() -> None:
    """After firing, three new occurrences are needed to fire again."""
    policy = _policy("    count: 2\n    within: 100\n")
    assert _fired_steps(policy, "1 1 1 1 1") == [2, 4]


@pytest.mark.timeout(10)
def test_count_within_duration_uses_timestamps() -> None:
    """within: 30s counts by event time, not by steps."""
    policy = _policy("    count: 2\n    within: 30s\n")
    assert _fired_steps(policy, "1 _x5 1", step_seconds=10.0) == []
    assert _fired_steps(policy, "1 _ 1", step_seconds=10.0) == [3]


@pytest.mark.timeout(10)
def test_ranks_at_one_step_count_once() -> None:
    """Eight ranks reporting the same step are one occurrence for count."""
    policy = _policy("    count: 2\n    within: 10\n")
    decisions = run_stream(policy, stream("loss_spike", "1", ranks=range(8)))
    assert decisions == []


@pytest.mark.timeout(10)
def test_group_by_rank_counts_each_rank() -> None:
    """group_by: [kind, step, rank] makes each rank its own occurrence."""
    policy = _policy("    count: 3\n    within: 1\n    group_by: [kind, step, rank]\n")
    decisions = run_stream(policy, stream("loss_spike", "1", ranks=range(3)))
    assert [d.ranks for d in decisions] == [(2,)]


@pytest.mark.timeout(10)
def test_persist_needs_consecutive_ticks() -> None:
    """persist: 3 fires only after three consecutive steps; a gap starts over."""
    policy = _policy("    persist: 3\n")
    assert _fired_steps(policy, "1 1 _ 1 1 _ 1 1 1") == [9]
    assert "held for 3 steps" in run_stream(policy, stream("loss_spike", "1x3"))[0].reason


@pytest.mark.timeout(10)
def test_persist_uses_ticks_across_rollbacks() -> None:
    """Consecutive ticks count even when the step goes back after a rollback."""
    engine = Engine(_policy("    persist: 2\n"))
    assert engine.decide([AnomalyEvent("loss_spike", 0, 100, tick=100)]) == []
    fired = engine.decide([AnomalyEvent("loss_spike", 0, 60, tick=101)])
    assert [d.step for d in fired] == [60]


@pytest.mark.timeout(10)
def test_cooldown_in_ticks_not_steps() -> None:
    """A cooldown counts executed ticks, so a rollback to an earlier step does not reset it."""
    engine = Engine(_policy("    cooldown_steps: 10\n"))
    assert engine.decide([AnomalyEvent("loss_spike", 0, 100, tick=100)])
    again = engine.decide([AnomalyEvent("loss_spike", 0, 95, tick=105)])
    assert again[0].suppressed
    later = engine.decide([AnomalyEvent("loss_spike", 0, 100, tick=110)])
    assert not later[0].suppressed


@pytest.mark.timeout(10)
def test_cooldown_duration() -> None:
    """cooldown: 1m suppresses by time: steps 10 s apart fire every 6 steps."""
    policy = _policy("    cooldown: 1m\n")
    assert _fired_steps(policy, "1x13", step_seconds=10.0) == [1, 7, 13]


@pytest.mark.timeout(10)
def test_now_overrides_event_time() -> None:
    """decide(now=...) sets the clock used by duration windows."""
    engine = Engine(_policy("    cooldown: 1m\n"))
    assert engine.decide([AnomalyEvent("loss_spike", 0, 1)], now=1000.0)
    assert engine.decide([AnomalyEvent("loss_spike", 0, 2)], now=1030.0)[0].suppressed
    assert not engine.decide([AnomalyEvent("loss_spike", 0, 3)], now=1061.0)[0].suppressed


@pytest.mark.timeout(10)
def test_backoff_doubles_cooldown_up_to_max() -> None:
    """backoff factor 2 grows the cooldown 10, 20, 40, then caps at max 50."""
    policy = _policy("    cooldown_steps: 10\n    backoff: {factor: 2, max: 50}\n")
    assert _fired_steps(policy, "1x200") == [1, 11, 31, 71, 121, 171]


@pytest.mark.timeout(10)
def test_backoff_resets_after_healthy_period() -> None:
    """After reset_after quiet steps the cooldown starts again from its base."""
    policy = _policy("    cooldown_steps: 10\n    backoff: {factor: 2, reset_after: 100}\n")
    fired = _fired_steps(policy, "1x40 _x200 1x12")
    assert fired == [1, 11, 31, 241, 251]


@pytest.mark.timeout(10)
def test_backoff_initial_without_cooldown() -> None:
    """backoff.initial gives the base cooldown when the rule has none."""
    policy = _policy("    backoff: {initial: 5, factor: 3}\n")
    assert _fired_steps(policy, "1x30") == [1, 6, 21]
