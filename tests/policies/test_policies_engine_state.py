"""Engine persistence (state_dict / load_state_dict) and hot reload."""

from __future__ import annotations

import json

import pytest

from remedy.policies import AnomalyEvent, Engine, StateError, load_policy_text

POLICY = """\
version: 1
inhibit:
  - {while: rollback, anomalies: [loss_spike], warmup_steps: 5}
rules:
  - name: nan
    when: {anomaly: nonfinite_loss}
    do: [rollback, shrink_lr]
    cooldown_steps: 50
    max_fires: 2
  - name: spike
    when: {anomaly: loss_spike}
    count: 2
    within: 100
    do: [skip_batches: {count: 3}]
"""


def _nan(step: int) -> list[AnomalyEvent]:
    return [AnomalyEvent("nonfinite_loss", 0, step)]


@pytest.mark.timeout(10)
def test_state_dict_is_json() -> None:
    """state_dict survives json.dumps/loads unchanged."""
    engine = Engine(load_policy_text(POLICY))
    engine.decide([*_nan(5), AnomalyEvent("loss_spike", 1, 5, value=float("nan"))])
    state = engine.state_dict()
    assert json.loads(json.dumps(state)) == state


@pytest.mark.timeout(10)
def test_restored_engine_keeps_cooldown_and_in_flight() -> None:
    """A restarted supervisor keeps cooldowns, the budget and pending outcomes."""
    first = Engine(load_policy_text(POLICY), run_id="r")
    rollback, _ = first.decide(_nan(10))
    second = Engine(load_policy_text(POLICY), run_id="r")
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    (held,) = second.decide(_nan(20))
    assert held.suppressed
    assert "cooling down" in held.reason
    assert held.decision_id == "r-d00003"
    assert second.decide([AnomalyEvent("loss_spike", 0, 21)])[0].suppressed  # inhibited
    assert second.record_outcome(rollback.decision_id, "applied", tick=22) == []


@pytest.mark.timeout(10)
def test_restored_engine_keeps_counts() -> None:
    """A count in progress survives a restart."""
    first = Engine(load_policy_text(POLICY))
    assert first.decide([AnomalyEvent("loss_spike", 0, 1)]) == []
    second = Engine(load_policy_text(POLICY))
    second.load_state_dict(first.state_dict())
    assert second.decide([AnomalyEvent("loss_spike", 0, 2)])[0].action == "skip_batches"


@pytest.mark.parametrize("bad", [{}, {"format": 1}, {"format": 1, "rules": 3}, "nope"])
@pytest.mark.timeout(10)
def test_malformed_state_raises_state_error(bad: object) -> None:
    """A malformed state raises StateError and leaves the engine untouched."""
    engine = Engine(load_policy_text(POLICY))
    before = engine.state_dict()
    with pytest.raises(StateError):
        engine.load_state_dict(bad)  # type: ignore[arg-type]
    assert engine.state_dict() == before


@pytest.mark.timeout(10)
def test_reload_preserves_counters_of_kept_rules() -> None:
    """After reload, max_fires and cooldown of a rule with the same name carry on."""
    engine = Engine(load_policy_text(POLICY))
    for step in (10, 100):
        for d in engine.decide(_nan(step)):
            engine.record_outcome(d.decision_id, "applied", tick=step)
    engine.reload(load_policy_text(POLICY.replace("shrink_lr]", "shrink_lr: {factor: 0.25}]")))
    assert engine.policy.rule("nan") is not None
    (abort,) = engine.decide(_nan(200))
    assert abort.action == "abort"


@pytest.mark.timeout(10)
def test_reload_drops_removed_rules_and_adds_new_ones() -> None:
    """Removed rules stop matching; new rules start with fresh counters."""
    engine = Engine(load_policy_text(POLICY))
    engine.decide([AnomalyEvent("loss_spike", 0, 1)])
    replacement = POLICY.replace("name: spike", "name: spike-v2")
    engine.reload(load_policy_text(replacement))
    assert engine.decide([AnomalyEvent("loss_spike", 0, 2)]) == []
    assert "spike" not in engine.state_dict()["rules"]


@pytest.mark.timeout(10)
def test_reload_keeps_in_flight_budget() -> None:
    """A rollback in flight before a reload still holds the budget after it."""
    text = POLICY + "  - name: hang\n    when: {anomaly: rank_hang}\n    do: [restart_rank]\n"
    engine = Engine(load_policy_text(text))
    rollback, _ = engine.decide(_nan(10))
    engine.reload(load_policy_text(text))
    assert engine.decide([AnomalyEvent("rank_hang", 1, 11)])[0].suppressed
    engine.record_outcome(rollback.decision_id, "applied", tick=12)
    assert not engine.decide([AnomalyEvent("rank_hang", 1, 13)])[0].suppressed


@pytest.mark.timeout(10)
def test_reload_can_change_limits() -> None:
    """Raising max_fires in a reload lets an exhausted rule fire again."""
    engine = Engine(load_policy_text(POLICY))
    for step in (10, 100):
        for d in engine.decide(_nan(step)):
            engine.record_outcome(d.decision_id, "applied", tick=step)
    engine.reload(load_policy_text(POLICY.replace("max_fires: 2", "max_fires: 5")))
    assert engine.decide(_nan(200))[0].action == "rollback"
