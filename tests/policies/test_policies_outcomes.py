"""Outcomes and escalation chains: on_failure next / abort / rule, and rule escalation."""

from __future__ import annotations

import pytest

from remedy.policies import AnomalyEvent, Engine, load_policy_text
from remedy.policies.testing import actions_by_step, run_stream, stream

POLICY = """\
version: 1
rules:
  - name: nan
    when: {anomaly: nonfinite_loss}
    do:
      - checkpoint_now:
        on_failure: next
      - rollback: {steps_back: 20}
        on_failure: {rule: last-resort}
      - shrink_lr: {factor: 0.5}
        on_failure: abort
  - name: last-resort
    when: {anomaly: nonfinite_loss}
    do:
      - skip_batches: {count: 50}
      - notify: {message: "rollback failed; skipped 50 batches"}
  - name: spike
    when: {anomaly: loss_spike}
    do: [rollback]
    max_fires: 1
    on_exhausted: {rule: spike-escalated}
  - name: spike-escalated
    when: {anomaly: loss_spike}
    do: [shrink_lr, notify]
    max_fires: 1
    on_exhausted: {rule: spike}
"""


@pytest.fixture
def engine() -> Engine:
    return Engine(load_policy_text(POLICY), run_id="o")


@pytest.mark.timeout(10)
def test_on_failure_next_lets_the_issued_rest_go_ahead(engine: Engine) -> None:
    """on_failure: next issues nothing new: the later steps, issued with it, stay in force."""
    chain = engine.decide([AnomalyEvent("nonfinite_loss", 0, 10)])
    assert [d.continue_on_failure for d in chain] == [True, False, False]
    assert not chain[0].ends_chain_on_failure and chain[1].ends_chain_on_failure
    follow = engine.record_outcome(chain[0].decision_id, "failed", tick=10, detail="disk full")
    assert follow == []
    # The rollback is still awaited: its failure escalates as its own on_failure says.
    again = engine.record_outcome(chain[1].decision_id, "failed", tick=11)
    assert [(d.rule, d.action) for d in again] == [
        ("last-resort", "skip_batches"),
        ("last-resort", "notify"),
    ]


@pytest.mark.timeout(10)
def test_readme_on_failure_next_example_runs_each_step_once() -> None:
    """The README's chain with a failed checkpoint_now carries out each step once."""
    policy = load_policy_text(
        "version: 1\nrules:\n  - name: r\n    when: {anomaly: loss_spike}\n    do:\n"
        "      - checkpoint_now:\n        on_failure: next\n"
        "      - rollback: {steps_back: 20}\n      - shrink_lr: {factor: 0.5}\n"
    )
    decisions = run_stream(
        policy, stream("loss_spike", "_x9 1.0"), outcomes={(10, "checkpoint_now"): "failed"}
    )
    assert actions_by_step(decisions) == {10: ["checkpoint_now", "rollback", "shrink_lr"]}


@pytest.mark.timeout(10)
def test_on_failure_rule_runs_that_rules_chain(engine: Engine) -> None:
    """on_failure: {rule: X} answers with rule X's chain."""
    chain = engine.decide([AnomalyEvent("nonfinite_loss", 0, 10)])
    follow = engine.record_outcome(chain[1].decision_id, "failed", tick=11)
    assert [(d.rule, d.action) for d in follow] == [
        ("last-resort", "skip_batches"),
        ("last-resort", "notify"),
    ]
    assert "escalating" not in follow[0].reason
    assert "rule 'nan' says on_failure: rule 'last-resort'" in follow[0].reason


@pytest.mark.timeout(10)
def test_on_failure_abort(engine: Engine) -> None:
    """on_failure: abort answers a failure with an abort decision."""
    chain = engine.decide([AnomalyEvent("nonfinite_loss", 0, 10)])
    (abort,) = engine.record_outcome(chain[2].decision_id, "failed", tick=11, detail="no optimizer")
    assert abort.action == "abort"
    assert "shrink_lr" in abort.reason
    assert "no optimizer" in abort.params["reason"]


@pytest.mark.timeout(10)
def test_applied_outcome_has_no_follow_up(engine: Engine) -> None:
    """An applied outcome returns no decisions."""
    chain = engine.decide([AnomalyEvent("nonfinite_loss", 0, 10)])
    assert engine.record_outcome(chain[1].decision_id, "applied", tick=11) == []


@pytest.mark.timeout(10)
def test_failure_without_on_failure_returns_nothing() -> None:
    """A failed step with no on_failure yields no follow-up."""
    engine = Engine(load_policy_text(POLICY))
    spike = engine.decide([AnomalyEvent("loss_spike", 0, 1)])
    assert engine.record_outcome(spike[0].decision_id, "failed", tick=1) == []


@pytest.mark.timeout(10)
def test_exhausted_rule_escalates_to_named_rule(engine: Engine) -> None:
    """on_exhausted: {rule: X} fires X's chain, with a reason naming both rules."""
    (rollback,) = engine.decide([AnomalyEvent("loss_spike", 0, 1)])
    engine.record_outcome(rollback.decision_id, "applied", tick=1)
    escalated = engine.decide([AnomalyEvent("loss_spike", 0, 2)])
    assert [(d.rule, d.action) for d in escalated] == [
        ("spike-escalated", "shrink_lr"),
        ("spike-escalated", "notify"),
    ]
    assert (
        "rule 'spike' fired max_fires=1 times in this run; escalating to rule"
        in escalated[0].reason
    )


@pytest.mark.timeout(10)
def test_escalation_cycle_terminates(engine: Engine) -> None:
    """A cycle of exhausted rules ends: each escalates once per exhaustion, then stays quiet."""
    out = []
    for step in range(1, 8):
        for d in engine.decide([AnomalyEvent("loss_spike", 0, step)]):
            out.append(d)
            if d.disruptive and not d.suppressed:
                engine.record_outcome(d.decision_id, "applied", tick=step)
    carried = [d for d in out if not d.suppressed]
    assert len(carried) <= 4
    assert out[-1].suppressed


@pytest.mark.timeout(10)
def test_rule_without_when_runs_only_by_escalation() -> None:
    """A rule with no `when` matches no event but runs when escalated to."""
    policy = load_policy_text(
        "version: 1\nrules:\n"
        "  - name: big\n    when: [{anomaly: loss_spike}, {value: '> 5'}]\n    do: [rollback]\n"
        "    max_fires: 1\n    on_exhausted: {rule: cut}\n"
        "  - name: cut\n    do: [shrink_lr]\n"
    )
    engine = Engine(policy)
    assert engine.decide([AnomalyEvent("loss_spike", 0, 1, value=1.0)]) == []
    (rollback,) = engine.decide([AnomalyEvent("loss_spike", 0, 2, value=9.0)])
    engine.record_outcome(rollback.decision_id, "applied", tick=2)
    (cut,) = engine.decide([AnomalyEvent("loss_spike", 0, 3, value=9.0)])
    assert (cut.rule, cut.action) == ("cut", "shrink_lr")
