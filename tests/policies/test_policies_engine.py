"""The engine: grouping, counting, rate limits, escalation, budget, outcomes."""

from __future__ import annotations

import json

import pytest

from remedy.policies import AnomalyEvent, Decision, Engine, OutcomeError, load_policy_text
from remedy.policies.testing import actions_by_step, assert_decisions, run_stream, stream

NAN_RULE = """\
version: 1
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 50, skip_batches: 20}
      - shrink_lr: {factor: 0.5, min_lr: 1.0e-6}
    cooldown_steps: 100
    max_fires: 3
"""


def _policy(text: str = NAN_RULE, **subs: str):  # type: ignore[no-untyped-def]
    for old, new in subs.items():
        text = text.replace(old, new)
    return load_policy_text(text)


def _nan(step: int, ranks: range = range(1), **kw: object) -> list[AnomalyEvent]:
    return [AnomalyEvent("nonfinite_loss", r, step, **kw) for r in ranks]  # type: ignore[arg-type]


def _fired(decisions: list[Decision]) -> list[Decision]:
    return [d for d in decisions if not d.suppressed]


@pytest.mark.timeout(10)
def test_match_yields_one_decision_per_chain_step() -> None:
    """A match gives the whole chain: same chain id, indexes 0..n-1, filled params."""
    engine = Engine(_policy(), run_id="r")
    first, second = engine.decide(_nan(150))
    assert (first.decision_id, second.decision_id) == ("r-d00001", "r-d00002")
    assert first.chain_id == second.chain_id == "r-d00001"
    assert (first.chain_index, second.chain_index, second.chain_length) == (0, 1, 2)
    assert first.params == {"steps_back": 50, "skip_batches": 20}
    assert first.disruptive
    assert not second.disruptive
    assert "matched rule 'nan-rollback'" in first.reason
    assert "rolling back 50 steps and skipping 20 batches" in first.reason
    assert "fire 1 of 3" in first.reason


@pytest.mark.timeout(10)
def test_same_anomaly_on_many_ranks_is_one_decision() -> None:
    """Events of one kind at one step from 8 ranks are grouped into one decision."""
    engine = Engine(_policy())
    decisions = engine.decide(_nan(10, range(8)))
    assert [d.action for d in decisions] == ["rollback", "shrink_lr"]
    assert decisions[0].ranks == tuple(range(8))
    assert "ranks 0-7" in decisions[0].reason


@pytest.mark.timeout(10)
def test_late_events_of_a_decided_group_are_absorbed() -> None:
    """Ranks reporting the same step in a later batch do not cause a second decision."""
    engine = Engine(_policy(cooldown_steps="cooldown_steps", **{"cooldown_steps: 100": ""}))
    assert _fired(engine.decide(_nan(10, range(4))))
    assert engine.decide(_nan(10, range(4, 8))) == []


@pytest.mark.timeout(10)
def test_cooldown_suppresses_once_per_period() -> None:
    """Within the cooldown a match is suppressed, with one record per cooldown period."""
    decisions = run_stream(_policy(), stream("nonfinite_loss", "1x150"))
    fired = actions_by_step(decisions)
    assert sorted(fired) == [1, 101]
    suppressed = [d for d in decisions if d.suppressed]
    assert [d.step for d in suppressed] == [2, 102]
    assert "cooling down for 99 more steps" in suppressed[0].reason


@pytest.mark.timeout(10)
def test_max_fires_escalates_to_abort_then_stays_quiet() -> None:
    """After max_fires firings the next match escalates once; later ones are suppressed."""
    decisions = run_stream(_policy(), stream("nonfinite_loss", "1 _x99 1 _x99 1 _x99 1 _x99 1"))
    assert_decisions(
        decisions,
        {
            1: ["rollback", "shrink_lr"],
            101: ["rollback", "shrink_lr"],
            201: ["rollback", "shrink_lr"],
            301: ["abort"],
        },
    )
    abort = next(d for d in decisions if d.action == "abort")
    assert (
        "rule 'nan-rollback' fired max_fires=3 times in this run; escalating to abort"
        in abort.reason
    )
    assert abort.params["reason"] == abort.reason
    assert decisions[-1].suppressed
    assert "already escalated" in decisions[-1].reason


LADDER = """
version: 1
rules:
  - name: rescue
    when: {anomaly: learning_stopped}
    do: [{rescale_grad_scaler: {scale: 1024.0}}]
    max_fires: 2
    on_exhausted: {rule: roll}
  - name: roll
    do: [{rollback: {steps_back: 10}}]
    max_fires: 2
    on_exhausted: abort
"""


def test_an_exhausted_rule_climbs_its_ladder_at_every_match() -> None:
    """A rule exhausted towards another rule hands each later match to it: two rescues, two
    rollbacks, then the rollbacks' abort, once; nothing after it."""
    decisions = run_stream(
        load_policy_text(LADDER), stream("learning_stopped", "1 _x9 1 _x9 1 _x9 1 _x9 1 _x9 1")
    )
    assert_decisions(
        decisions,
        {1: ["rescale_grad_scaler"], 11: ["rescale_grad_scaler"], 21: ["rollback"],
         31: ["rollback"], 41: ["abort"]},
    )  # fmt: skip
    assert [d.rule for d in decisions if not d.suppressed][2:4] == ["roll", "roll"]
    assert decisions[-1].suppressed and "already escalated" in decisions[-1].reason


@pytest.mark.timeout(10)
def test_fires_within_frees_slots_as_the_window_slides() -> None:
    """With fires_within, old firings leave the window and the rule fires again."""
    policy = _policy(**{"max_fires: 3": "max_fires: 1\n    fires_within: 200"})
    decisions = run_stream(policy, stream("nonfinite_loss", "1 _x99 1 _x99 1"))
    assert_decisions(
        decisions, {1: ["rollback", "shrink_lr"], 101: ["abort"], 201: ["rollback", "shrink_lr"]}
    )


@pytest.mark.timeout(10)
def test_on_exhausted_notify() -> None:
    """on_exhausted: notify escalates with a notify carrying the reason as message."""
    policy = _policy(**{"max_fires: 3": "max_fires: 1\n    on_exhausted: notify"})
    decisions = run_stream(policy, stream("nonfinite_loss", "1 _x99 1"))
    notify = _fired(decisions)[-1]
    assert notify.action == "notify"
    assert notify.params["message"] == notify.reason


@pytest.mark.timeout(10)
def test_decision_ids_are_deterministic() -> None:
    """The same stream gives the same decisions and ids in two engines."""
    events = stream("nonfinite_loss", "1x3 _x200 1x3", ranks=range(4))
    assert run_stream(_policy(), events) == run_stream(_policy(), events)


@pytest.mark.timeout(10)
def test_disruptive_budget_holds_back_second_disruptive_action() -> None:
    """While a rollback is in flight another rule's restart_rank is suppressed; it is not
    decided again (the hang is reported again while it lasts)."""
    text = NAN_RULE + "  - name: restart\n    when: {anomaly: rank_hang}\n    do: [restart_rank]\n"
    engine = Engine(load_policy_text(text))
    rollback = engine.decide(_nan(10))[0]
    held = engine.decide([AnomalyEvent("rank_hang", 3, 11)])
    assert held[0].suppressed
    assert "still in flight" in held[0].reason
    assert engine.record_outcome(rollback.decision_id, "applied", tick=12) == []
    assert not engine.decide([AnomalyEvent("rank_hang", 3, 13)])[0].suppressed


SPIKE_AND_RESTART = """\
version: 1
rules:
  - name: restart
    when: {anomaly: rank_hang}
    do: [restart_rank]
  - name: spike-rollback
    when: {anomaly: loss_spike}
    do:
      - rollback: {steps_back: 20, skip_batches: 30}
"""


@pytest.mark.timeout(10)
def test_a_rollback_held_behind_a_restart_is_decided_once_the_restart_is_applied() -> None:
    """A spike found while a rank restart is in flight: its rollback is held back, then
    decided when the restart is applied (a spike is not reported again)."""
    engine = Engine(load_policy_text(SPIKE_AND_RESTART))
    (restart,) = engine.decide([AnomalyEvent("rank_hang", 1, 21)])
    (held,) = engine.decide([AnomalyEvent("loss_spike", 0, 30)])
    assert held.suppressed and "still in flight" in held.reason
    (rollback,) = engine.record_outcome(restart.decision_id, "applied", tick=31)
    assert (rollback.action, rollback.suppressed, rollback.anomaly.step) == ("rollback", False, 30)
    assert f"held back until restart_rank ({restart.decision_id}) was applied" in rollback.reason
    assert engine.record_outcome(rollback.decision_id, "applied", tick=33) == []


@pytest.mark.timeout(10)
def test_a_match_held_behind_a_failed_action_is_dropped() -> None:
    """A match held back behind a disruptive action that fails is not decided again (the
    failure's own follow-ups come first)."""
    engine = Engine(load_policy_text(SPIKE_AND_RESTART))
    (restart,) = engine.decide([AnomalyEvent("rank_hang", 1, 21)])
    assert engine.decide([AnomalyEvent("loss_spike", 0, 30)])[0].suppressed
    assert engine.record_outcome(restart.decision_id, "failed", tick=31) == []


@pytest.mark.timeout(10)
def test_record_outcome_rejects_unknown_outcome() -> None:
    """Outcomes other than applied/failed raise OutcomeError."""
    engine = Engine(_policy())
    with pytest.raises(OutcomeError):
        engine.record_outcome("x", "done", tick=1)


@pytest.mark.timeout(10)
def test_unknown_decision_outcome_is_ignored() -> None:
    """An outcome for an id the engine never issued returns no follow-ups."""
    assert Engine(_policy()).record_outcome("nope", "failed", tick=1) == []


@pytest.mark.timeout(10)
def test_engine_dry_run_marks_decisions_and_keeps_budget_free() -> None:
    """Engine(dry_run=True) marks decisions dry_run and never blocks on the budget."""
    engine = Engine(_policy(**{"cooldown_steps: 100": "cooldown_steps: 1"}), dry_run=True)
    first = engine.decide(_nan(10))
    second = engine.decide(_nan(20))
    assert all(d.dry_run for d in first + second)
    assert not any(d.suppressed for d in first + second)


@pytest.mark.timeout(10)
def test_policy_dry_run_flag() -> None:
    """dry_run: true in the policy has the same effect."""
    engine = Engine(_policy(**{"version: 1": "version: 1\ndry_run: true"}))
    assert engine.dry_run
    assert all(d.dry_run for d in engine.decide(_nan(1)))


@pytest.mark.timeout(10)
def test_state_dict_round_trips_through_json() -> None:
    """A restored engine carries on with the same cooldowns, counters and ids."""
    events = stream("nonfinite_loss", "1 _x40 1 _x99 1 _x99 1", ranks=range(2))
    whole = run_stream(_policy(), events)
    first = Engine(_policy(), run_id="test")
    head = [e for e in events if e.step <= 41]
    part = run_stream(first, head, engine=first)
    second = Engine(_policy(), run_id="test")
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    rest = run_stream(second, [e for e in events if e.step > 41], engine=second)
    assert part + rest == whole


@pytest.mark.timeout(10)
def test_events_sliced_by_tick_in_order() -> None:
    """One batch holding several ticks is judged tick by tick."""
    engine = Engine(_policy(**{"cooldown_steps: 100": "cooldown_steps: 1"}), dry_run=True)
    decisions = engine.decide(_nan(3) + _nan(1) + _nan(2))
    assert [d.step for d in decisions if d.chain_index == 0] == [1, 2, 3]
