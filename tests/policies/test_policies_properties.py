"""Properties over random event streams and random rate limits (hypothesis)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remedy.policies import AnomalyEvent, Decision, Engine, load_policy, load_policy_text
from remedy.policies._rules import Policy

KINDS = ("nonfinite_loss", "loss_spike", "rank_hang", "grad_norm_explosion", "oom", "data_stall")
ACTIONS = ("rollback", "restart_rank", "shrink_lr", "skip_batches: {count: 2}")

Stream = list[list[tuple[str, int]]]

streams = st.lists(
    st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 3)), max_size=5),
    min_size=1,
    max_size=120,
)


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    """A random policy: one rule per kind, random counts, windows, cooldowns and limits."""
    lines = ["version: 1", "rules:"]
    for kind in KINDS:
        lines += [f"  - name: r-{kind}", f"    when: {{anomaly: {kind}}}"]
        lines.append(f"    do: [{draw(st.sampled_from(ACTIONS))}, notify]")
        count = draw(st.integers(1, 3))
        if count > 1:
            lines += [f"    count: {count}", f"    within: {draw(st.integers(count, 20))}"]
        persist = draw(st.integers(1, 3))
        if persist > 1:
            lines.append(f"    persist: {persist}")
        cooldown = draw(st.integers(0, 15))
        lines.append(f"    cooldown_steps: {cooldown}")
        if cooldown and draw(st.booleans()):
            lines.append(f"    backoff: {{factor: 2, max: {cooldown * 4}, reset_after: 30}}")
        if draw(st.booleans()):
            lines += [f"    max_fires: {draw(st.integers(1, 4))}", "    on_exhausted: notify"]
            if draw(st.booleans()):
                lines.append(f"    fires_within: {draw(st.integers(1, 60))}")
    return load_policy_text("\n".join(lines) + "\n")


def _events(stream: Stream) -> list[list[AnomalyEvent]]:
    return [
        [AnomalyEvent(kind, rank, tick, ts=float(tick)) for kind, rank in step]
        for tick, step in enumerate(stream, start=1)
    ]


def _run(policy: Policy, stream: Stream, delays: Sequence[int] = (0,)) -> list[Decision]:
    """Run a stream, recording each decision's outcome a (cycling) number of ticks later."""
    engine = Engine(policy, run_id="p")
    due: dict[int, list[str]] = {}
    out: list[Decision] = []
    for tick, batch in enumerate(_events(stream), start=1):
        for decision_id in due.pop(tick, []):
            out.extend(engine.record_outcome(decision_id, "applied", tick=tick))
        for d in engine.decide(batch):
            out.append(d)
            if not d.suppressed:
                delay = delays[len(out) % len(delays)]
                due.setdefault(tick + delay, []).append(d.decision_id)
    return out


def _firings(policy: Policy, decisions: list[Decision]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.name: [] for r in policy.rules}
    for d in decisions:
        rule = policy.rule(d.rule)
        if rule is None or d.suppressed or d.chain_index != 0:
            continue
        if d.action == rule.steps[0].action:
            out[d.rule].append(d.anomaly.tick)
    return out


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(policy=policies(), stream=streams)
@pytest.mark.timeout(120)
def test_never_more_than_max_fires_within_window(policy: Policy, stream: Stream) -> None:
    """No rule fires more than max_fires times within any fires_within window."""
    fired = _firings(policy, _run(policy, stream))
    for rule in policy.rules:
        if rule.max_fires is None:
            continue
        ticks = fired[rule.name]
        if rule.fires_within is None:
            assert len(ticks) <= rule.max_fires
            continue
        width = rule.fires_within.amount
        for i, start in enumerate(ticks):
            inside = [t for t in ticks[i:] if t - start < width]
            assert len(inside) <= rule.max_fires


@SETTINGS
@given(policy=policies(), stream=streams)
@pytest.mark.timeout(120)
def test_cooldowns_respected(policy: Policy, stream: Stream) -> None:
    """Consecutive firings of a rule are at least its (base) cooldown apart."""
    fired = _firings(policy, _run(policy, stream))
    for rule in policy.rules:
        if rule.cooldown is None:
            continue
        ticks = fired[rule.name]
        assert all(b - a >= rule.cooldown.amount for a, b in itertools.pairwise(ticks))


@SETTINGS
@given(policy=policies(), stream=streams, delays=st.lists(st.integers(0, 6), min_size=1))
@pytest.mark.timeout(120)
def test_same_stream_same_decisions(policy: Policy, stream: Stream, delays: list[int]) -> None:
    """Running the same stream twice gives identical decisions and ids."""
    assert _run(policy, stream, delays) == _run(policy, stream, delays)


@SETTINGS
@given(
    name=st.sampled_from(["default", "llm-pretrain", "conservative"]),
    stream=streams,
    delays=st.lists(st.integers(0, 8), min_size=1, max_size=5),
)
@pytest.mark.timeout(120)
def test_one_disruptive_action_in_flight(name: str, stream: Stream, delays: list[int]) -> None:
    """A disruptive action is never issued while another one awaits its outcome."""
    engine = Engine(load_policy(name))
    in_flight: dict[str, int] = {}  # decision id -> tick its outcome arrives
    n = 0
    for tick, batch in enumerate(_events(stream), start=1):
        for decision_id, at in sorted(in_flight.items()):
            if at <= tick:
                del in_flight[decision_id]
                engine.record_outcome(decision_id, "applied", tick=tick)
        for d in engine.decide(batch):
            if d.suppressed or not d.disruptive:
                continue
            assert not in_flight, f"{d.decision_id} issued while {in_flight} in flight"
            n += 1
            in_flight[d.decision_id] = tick + delays[n % len(delays)]


@SETTINGS
@given(policy=policies(), stream=streams)
@pytest.mark.timeout(120)
def test_one_cooldown_record_per_cooldown(policy: Policy, stream: Stream) -> None:
    """Between two firings of a rule there is at most one 'cooling down' record for it."""
    decisions = _run(policy, stream)
    since_firing: dict[str, int] = {}
    for d in decisions:
        rule = policy.rule(d.rule)
        assert rule is not None
        if not d.suppressed and d.chain_index == 0 and d.action == rule.steps[0].action:
            since_firing[d.rule] = 0
        elif d.suppressed and "cooling down" in d.reason:
            since_firing[d.rule] = since_firing.get(d.rule, 0) + 1
            assert since_firing[d.rule] == 1
