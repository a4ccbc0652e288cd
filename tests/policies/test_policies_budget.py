"""The disruption budget and inhibitions (`inhibit:` with warm-ups)."""

from __future__ import annotations

import pytest

from remedy.policies import AnomalyEvent, Engine, load_policy_text
from remedy.policies._budget import Budget
from remedy.policies._rules import Inhibit, Policy

POLICY = """\
version: 1
inhibit:
  - {while: rollback, anomalies: [loss_spike], warmup_steps: 5}
rules:
  - name: nan
    when: {anomaly: nonfinite_loss}
    do: [rollback]
  - name: spike
    when: {anomaly: loss_spike}
    do: [rollback: {steps_back: 10, skip_batches: 5}]
  - name: hang
    when: {anomaly: rank_hang}
    do: [restart_rank]
  - name: grads
    when: {anomaly: grad_norm_explosion}
    do: [shrink_lr]
"""


@pytest.fixture
def policy() -> Policy:
    return load_policy_text(POLICY)


def _ev(kind: str, step: int, rank: int = 0) -> list[AnomalyEvent]:
    return [AnomalyEvent(kind, rank, step)]


@pytest.mark.timeout(10)
def test_one_disruptive_action_in_flight(policy: Policy) -> None:
    """A second disruptive action waits until the first has an outcome."""
    engine = Engine(policy)
    (rollback,) = engine.decide(_ev("nonfinite_loss", 10))
    (held,) = engine.decide(_ev("rank_hang", 11, rank=2))
    assert held.suppressed
    assert held.action == "restart_rank"
    assert rollback.decision_id in held.reason


@pytest.mark.timeout(10)
def test_non_disruptive_actions_are_not_held(policy: Policy) -> None:
    """shrink_lr goes ahead while a rollback is in flight."""
    engine = Engine(policy)
    engine.decide(_ev("nonfinite_loss", 10))
    (lr,) = engine.decide(_ev("grad_norm_explosion", 11))
    assert not lr.suppressed


@pytest.mark.timeout(10)
def test_budget_suppression_recorded_once_per_in_flight_action(policy: Policy) -> None:
    """Repeated matches while the same rollback is in flight give one suppressed record."""
    engine = Engine(policy)
    engine.decide(_ev("nonfinite_loss", 10))
    held = [d for s in range(11, 20) for d in engine.decide(_ev("rank_hang", s))]
    assert len(held) == 1


@pytest.mark.timeout(10)
def test_failed_outcome_frees_budget(policy: Policy) -> None:
    """A failed disruptive action frees the budget too."""
    engine = Engine(policy)
    (rollback,) = engine.decide(_ev("nonfinite_loss", 10))
    engine.record_outcome(rollback.decision_id, "failed", tick=10)
    (restart,) = engine.decide(_ev("rank_hang", 11))
    assert not restart.suppressed


@pytest.mark.timeout(10)
def test_inhibited_while_rollback_in_flight(policy: Policy) -> None:
    """A loss spike during a rollback fires nothing and says why."""
    engine = Engine(policy)
    engine.decide(_ev("nonfinite_loss", 10))
    (spike,) = engine.decide(_ev("loss_spike", 11))
    assert spike.suppressed
    assert "inhibited while rollback is in progress" in spike.reason


@pytest.mark.timeout(10)
def test_inhibit_warmup_counts_ticks_after_outcome(policy: Policy) -> None:
    """The warm-up lasts warmup_steps ticks from the applied outcome, then spikes fire again."""
    engine = Engine(policy)
    (rollback,) = engine.decide(_ev("nonfinite_loss", 10))
    engine.record_outcome(rollback.decision_id, "applied", tick=12)
    # After the rollback the step goes back, the tick keeps growing.
    assert engine.decide([AnomalyEvent("loss_spike", 0, 3, tick=16)])[0].suppressed
    fired = engine.decide([AnomalyEvent("loss_spike", 0, 4, tick=17)])
    assert not fired[0].suppressed
    assert fired[0].action == "rollback"


@pytest.mark.timeout(10)
def test_inhibition_leaves_other_anomalies_alone(policy: Policy) -> None:
    """Anomalies not listed in inhibit still fire (subject to the budget)."""
    engine = Engine(policy)
    (rollback,) = engine.decide(_ev("nonfinite_loss", 10))
    engine.record_outcome(rollback.decision_id, "applied", tick=10)
    (restart,) = engine.decide(_ev("rank_hang", 11))
    assert not restart.suppressed


@pytest.mark.timeout(10)
def test_inhibited_events_are_not_counted() -> None:
    """Spikes during a warm-up do not count towards a count rule."""
    text = POLICY.replace(
        "    when: {anomaly: loss_spike}\n",
        "    when: {anomaly: loss_spike}\n    count: 2\n    within: 50\n",
    )
    engine = Engine(load_policy_text(text))
    (rollback,) = engine.decide(_ev("nonfinite_loss", 10))
    engine.record_outcome(rollback.decision_id, "applied", tick=10)
    engine.decide(_ev("loss_spike", 12))
    assert engine.decide(_ev("loss_spike", 20)) == []
    assert engine.decide(_ev("loss_spike", 21))[0].action == "rollback"


@pytest.mark.timeout(10)
def test_budget_state_round_trip() -> None:
    """Budget.to_dict/from_dict keep in-flight and applied entries."""
    budget = Budget()
    budget.take("d1", "rollback", 5, disruptive=True)
    budget.mark_applied("restart_rank", 7, "d0")
    copy = Budget.from_dict(budget.to_dict())
    assert copy.busy() == ("d1", "rollback")
    entry = Inhibit("restart_rank", frozenset({"straggler"}), 10)
    found = copy.inhibition("straggler", 12, (entry,))
    assert found is not None
    assert found.period == "d0"
