"""Rate limits follow `group_by`: with `[kind]` each kind has its own counters; absurd ticks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remedy.policies import AnomalyEvent, Decision, Engine, StateError, load_policy_text

PER_KIND = """\
version: 1
rules:
  - name: tell
    when: {anomaly: [loss_oscillation, data_stall]}
    group_by: [kind]
    do: [notify]
    cooldown_steps: 200
  - name: pairs
    when: {anomaly: [straggler, collective_slow]}
    group_by: [kind]
    count: 2
    within: 50
    do: [dump_diagnostics]
  - name: once
    when: {anomaly: [grad_norm_explosion, update_stall]}
    group_by: [kind]
    max_fires: 1
    on_exhausted: notify
    do: [shrink_lr]
  - name: shared
    when: {anomaly: [nonfinite_loss, nonfinite_grad]}
    do: [rollback]
    cooldown_steps: 100
  - name: streak
    when: {anomaly: scaler_overflow}
    persist: 3
    backoff: {factor: 2, initial: 10, reset_after: 100}
    do: [rescale_grad_scaler: {factor: 0.5}]
"""


def _ev(kind: str, step: int, rank: int = 0) -> list[AnomalyEvent]:
    return [AnomalyEvent(kind, rank, step, value=1.0, severity="warning")]


def _acted(decisions: list[Decision]) -> list[tuple[str, str]]:
    return [(d.rule, d.action) for d in decisions if not d.suppressed]


@pytest.fixture
def engine() -> Engine:
    return Engine(load_policy_text(PER_KIND), run_id="k")


@pytest.mark.timeout(10)
def test_cooldown_is_per_kind(engine: Engine) -> None:
    """A data_stall is not held back by a loss_oscillation that fired the same rule 13 steps before."""
    assert _acted(engine.decide(_ev("loss_oscillation", 10))) == [("tell", "notify")]
    assert _acted(engine.decide(_ev("data_stall", 23))) == [("tell", "notify")]
    (held,) = engine.decide(_ev("loss_oscillation", 30))
    assert held.suppressed
    assert "cooling down for kind loss_oscillation for 180 more steps" in held.reason
    (held,) = engine.decide(_ev("data_stall", 40))
    assert held.suppressed and "kind data_stall for 183 more steps" in held.reason
    assert _acted(engine.decide(_ev("loss_oscillation", 210))) == [("tell", "notify")]


@pytest.mark.timeout(10)
def test_count_is_per_kind(engine: Engine) -> None:
    """count: 2 counts occurrences of one kind: one of each kind is not a pair."""
    assert _acted(engine.decide(_ev("straggler", 10))) == []
    assert _acted(engine.decide(_ev("collective_slow", 11))) == []
    assert _acted(engine.decide(_ev("collective_slow", 12))) == [("pairs", "dump_diagnostics")]
    assert _acted(engine.decide(_ev("straggler", 13))) == [("pairs", "dump_diagnostics")]


@pytest.mark.timeout(10)
def test_max_fires_and_escalation_are_per_kind(engine: Engine) -> None:
    """max_fires: 1 per kind: each kind fires once, then that kind escalates once."""
    assert _acted(engine.decide(_ev("grad_norm_explosion", 10))) == [("once", "shrink_lr")]
    assert _acted(engine.decide(_ev("update_stall", 11))) == [("once", "shrink_lr")]
    assert _acted(engine.decide(_ev("grad_norm_explosion", 12))) == [("once", "notify")]
    assert _acted(engine.decide(_ev("update_stall", 13))) == [("once", "notify")]
    assert _acted(engine.decide(_ev("update_stall", 14))) == []


@pytest.mark.timeout(10)
def test_group_by_with_step_keeps_one_state(engine: Engine) -> None:
    """With the default group_by [kind, step] the cooldown is the rule's, across its kinds."""
    assert _acted(engine.decide(_ev("nonfinite_loss", 10))) == [("shared", "rollback")]
    (held,) = engine.decide(_ev("nonfinite_grad", 20))
    assert held.suppressed and "cooling down for 90 more steps" in held.reason


@pytest.mark.timeout(10)
def test_per_kind_state_survives_state_dict_round_trip(engine: Engine) -> None:
    """state_dict/load_state_dict keep each kind's cooldown, through JSON."""
    engine.decide(_ev("loss_oscillation", 10))
    engine.decide(_ev("straggler", 11))
    state = json.loads(json.dumps(engine.state_dict()))
    restored = Engine(load_policy_text(PER_KIND), run_id="k")
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert restored.decide(_ev("loss_oscillation", 20))[0].suppressed
    assert _acted(restored.decide(_ev("data_stall", 21))) == [("tell", "notify")]
    assert _acted(restored.decide(_ev("straggler", 22))) == [("pairs", "dump_diagnostics")]


@pytest.mark.timeout(10)
def test_hot_reload_keeps_per_kind_state_unless_the_key_changes(engine: Engine) -> None:
    """A reload keeps per-kind cooldowns; changing group_by's fields starts the rule over."""
    engine.decide(_ev("loss_oscillation", 10))
    engine.reload(load_policy_text(PER_KIND))
    assert engine.decide(_ev("loss_oscillation", 20))[0].suppressed
    assert _acted(engine.decide(_ev("data_stall", 21))) == [("tell", "notify")]
    engine.reload(
        load_policy_text(
            PER_KIND.replace(
                "group_by: [kind]\n    do: [notify]", "group_by: [kind, rank]\n    do: [notify]"
            )
        )
    )
    assert _acted(engine.decide(_ev("loss_oscillation", 30))) == [("tell", "notify")]


@pytest.mark.timeout(10)
def test_an_absurd_step_does_not_cool_a_rule_down_for_ever() -> None:
    """An event at step 10**30 fires once; genuine events after it are judged on their own ticks."""
    engine = Engine(load_policy_text(PER_KIND), run_id="k")
    assert _acted(engine.decide(_ev("data_stall", 10**30))) == [("tell", "notify")]
    assert _acted(engine.decide(_ev("data_stall", 100))) == [("tell", "notify")]
    assert engine.decide(_ev("data_stall", 150))[0].suppressed  # its own 200-step cooldown
    assert _acted(engine.decide(_ev("data_stall", 300))) == [("tell", "notify")]
    # The rollback rule's max_fires window and persist streaks are not held open either.
    for step in (10**30, 1000, 1200):
        (rollback,) = engine.decide(_ev("nonfinite_loss", step))
        assert (rollback.rule, rollback.suppressed) == ("shared", False)
        engine.record_outcome(rollback.decision_id, "applied", tick=step)


@pytest.mark.timeout(10)
def test_state_without_keys_from_an_older_engine_restores() -> None:
    """A saved state from before per-key counters restores into a per-rule rule."""
    engine = Engine(load_policy_text(PER_KIND), run_id="k")
    engine.decide(_ev("nonfinite_loss", 10))
    state = engine.state_dict()
    flat = state["rules"]["shared"]["keys"][0][1] | {"recent": state["rules"]["shared"]["recent"]}
    state["rules"]["shared"] = flat
    restored = Engine(load_policy_text(PER_KIND), run_id="k")
    restored.load_state_dict(state)
    assert restored.decide(_ev("nonfinite_grad", 20))[0].suppressed


steps = st.lists(st.integers(1, 600), max_size=40).map(lambda s: sorted(set(s)))


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None)
@given(a=steps, b=steps)
def test_each_kind_is_decided_as_if_alone(a: list[int], b: list[int]) -> None:
    """With group_by [kind], two kinds in one stream get the decisions each would get alone."""

    def run(stream: list[tuple[int, str]]) -> set[tuple[int, str, str, bool]]:
        engine = Engine(load_policy_text(PER_KIND))
        out: set[tuple[int, str, str, bool]] = set()
        for step in sorted({s for s, _ in stream}):
            batch = [e for s, kind in stream if s == step for e in _ev(kind, step)]
            out.update((d.step, d.rule, d.action, d.suppressed) for d in engine.decide(batch))
        return out

    for first, second in (("loss_oscillation", "data_stall"), ("straggler", "collective_slow")):
        alone = run([(s, first) for s in a]) | run([(s, second) for s in b])
        together = run([(s, first) for s in a] + [(s, second) for s in b])
        assert together == alone


@pytest.mark.timeout(10)
def test_an_absurd_outcome_tick_does_not_inhibit_for_ever() -> None:
    """A rollback recorded as applied at tick 10**30 does not start a 10**30-tick warm-up."""
    policy = load_policy_text(
        "version: 1\ninhibit:\n  - {while: rollback, anomalies: [loss_spike], warmup_steps: 20}\n"
        "rules:\n  - name: nan\n    when: {anomaly: nonfinite_loss}\n    do: [rollback]\n"
        "  - name: spike\n    when: {anomaly: loss_spike}\n    do: [skip_batches: {count: 1}]\n"
    )
    engine = Engine(policy)
    (rollback,) = engine.decide(_ev("nonfinite_loss", 10))
    engine.record_outcome(rollback.decision_id, "applied", tick=10**30)
    assert _acted(engine.decide(_ev("loss_spike", 12))) == [("spike", "skip_batches")]
    (rollback,) = engine.decide(_ev("nonfinite_loss", 100))
    engine.record_outcome(rollback.decision_id, "applied", tick=101)
    assert engine.decide(_ev("loss_spike", 110))[0].suppressed  # a genuine warm-up holds


def _mutations(state: object) -> st.SearchStrategy[object]:
    junk = (
        st.none()
        | st.integers(-(10**400), 10**400)
        | st.text(max_size=3)
        | st.just([])
        | st.just({})
    )
    return st.recursive(junk, lambda inner: st.lists(inner, max_size=3), max_leaves=4)


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_corrupted_state_is_refused_with_state_error_or_loads_into_an_engine_that_runs(
    data: st.DataObject,
) -> None:
    """A saved state with one value replaced by junk: StateError, or an engine that runs."""
    engine = Engine(load_policy_text(PER_KIND), run_id="k")
    engine.decide(_ev("loss_oscillation", 10) + _ev("straggler", 10))
    engine.decide(_ev("nonfinite_loss", 11))
    for step in (11, 12, 13, 14):
        engine.decide(_ev("scaler_overflow", step))
    state = json.loads(json.dumps(engine.state_dict()))
    paths: list[tuple[object, object]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                paths.append((node, key))
                walk(value)
        elif isinstance(node, list):
            for index, value in enumerate(node):
                paths.append((node, index))
                walk(value)

    walk(state)
    parent, key = data.draw(st.sampled_from(paths))
    parent[key] = data.draw(_mutations(state))  # type: ignore[index]
    restored = Engine(load_policy_text(PER_KIND))
    try:
        restored.load_state_dict(state)
    except StateError:
        return
    # What restored must also run: the same events again, and later ones.
    for step in (12, 400):
        kinds = ("loss_oscillation", "straggler", "nonfinite_loss", "grad_norm_explosion")
        for kind in (*kinds, "scaler_overflow"):
            for d in restored.decide(_ev(kind, step)):
                if not d.suppressed:
                    restored.record_outcome(d.decision_id, "applied", tick=step)
