"""Predicates (`when`), rule order, `continue`, and grouping."""

from __future__ import annotations

import pytest

from remedy.policies import AnomalyEvent, Engine, load_policy_text
from remedy.policies._predicates import Comparison, Matcher, parse_comparison
from remedy.policies._rules import Policy


def _policy(*rules: str) -> Policy:
    return load_policy_text("version: 1\nrules:\n" + "".join(rules))


def _rule(name: str, when: str, action: str = "notify", extra: str = "") -> str:
    return f"  - name: {name}\n    when: {when}\n    do: [{action}]\n{extra}"


def _rules_hit(policy: Policy, *events: AnomalyEvent) -> list[str]:
    return [d.rule for d in Engine(policy).decide(list(events))]


@pytest.mark.parametrize(
    ("when", "event", "hit"),
    [
        ("{anomaly: [oom, loss_spike]}", AnomalyEvent("oom", 0, 1), True),
        ("{anomaly: oom}", AnomalyEvent("loss_spike", 0, 1), False),
        ("{severity: warning}", AnomalyEvent("oom", 0, 1, severity="critical"), True),
        ("{severity: critical}", AnomalyEvent("oom", 0, 1, severity="warning"), False),
        ("{ranks: [1, 2]}", AnomalyEvent("oom", 2, 1), True),
        ("{ranks: 1}", AnomalyEvent("oom", 2, 1), False),
        ("{source: supervisor}", AnomalyEvent("oom", 0, 1, source="supervisor"), True),
        ("{source: [hardware]}", AnomalyEvent("oom", 0, 1), False),
        ('{value: "> 1e5"}', AnomalyEvent("oom", 0, 1, value=2e5), True),
        ('{value: "> 1e5"}', AnomalyEvent("oom", 0, 1, value=None), False),
        ('{value: "<= -1"}', AnomalyEvent("oom", 0, 1, value=-1.0), True),
        ('{ratio: ">= 10"}', AnomalyEvent("oom", 0, 1, value=50.0, threshold=5.0), True),
        ('{ratio: ">= 10"}', AnomalyEvent("oom", 0, 1, value=50.0, threshold=0.0), False),
        ('{threshold: "!= 0"}', AnomalyEvent("oom", 0, 1, threshold=3.0), True),
        ('{step: "< 100"}', AnomalyEvent("oom", 0, 150), False),
        (
            '[{anomaly: oom}, {value: "> 1"}, {value: "< 10"}]',
            AnomalyEvent("oom", 0, 1, value=5.0),
            True,
        ),
        (
            '[{anomaly: oom}, {value: "> 1"}, {value: "< 10"}]',
            AnomalyEvent("oom", 0, 1, value=50.0),
            False,
        ),
    ],
)
@pytest.mark.timeout(10)
def test_predicate_matching(when: str, event: AnomalyEvent, hit: bool) -> None:
    """Each predicate form matches exactly the events it describes."""
    policy = _policy(_rule("r", when))
    assert bool(_rules_hit(policy, event)) is hit


@pytest.mark.timeout(10)
def test_first_match_wins() -> None:
    """Rules run in file order; the first match claims the event."""
    policy = _policy(_rule("a", "{anomaly: oom}"), _rule("b", "{anomaly: oom}"))
    assert _rules_hit(policy, AnomalyEvent("oom", 0, 1)) == ["a"]


@pytest.mark.timeout(10)
def test_continue_lets_later_rules_see_the_event() -> None:
    """continue: true passes the event on after firing."""
    policy = _policy(
        _rule("a", "{anomaly: oom}", extra="    continue: true\n"), _rule("b", "{anomaly: oom}")
    )
    assert _rules_hit(policy, AnomalyEvent("oom", 0, 1)) == ["a", "b"]


@pytest.mark.timeout(10)
def test_counting_rule_passes_events_on_until_it_fires() -> None:
    """A count rule still counting lets later rules act; when it fires it claims."""
    policy = _policy(
        _rule("three", "{anomaly: loss_spike}", "rollback", "    count: 3\n    within: 10\n"),
        _rule("each", "{anomaly: loss_spike}", "skip_batches: {count: 2}"),
    )
    engine = Engine(policy)
    hits = [d.rule for s in (1, 2, 3) for d in engine.decide([AnomalyEvent("loss_spike", 0, s)])]
    assert hits == ["each", "each", "three"]


@pytest.mark.timeout(10)
def test_rule_claims_during_its_cooldown() -> None:
    """While a rule cools down after firing, its matches do not fall through."""
    policy = _policy(
        _rule("first", "{anomaly: oom}", extra="    cooldown_steps: 10\n"),
        _rule("second", "{anomaly: oom}"),
    )
    engine = Engine(policy)
    engine.decide([AnomalyEvent("oom", 0, 1)])
    (held,) = engine.decide([AnomalyEvent("oom", 0, 2)])
    assert held.rule == "first"
    assert held.suppressed


@pytest.mark.timeout(10)
def test_different_kinds_in_one_batch_get_their_own_rules() -> None:
    """One batch with two kinds gives decisions from both rules, in rule order."""
    policy = _policy(_rule("a", "{anomaly: oom}"), _rule("b", "{anomaly: loss_spike}"))
    hits = _rules_hit(policy, AnomalyEvent("loss_spike", 0, 1), AnomalyEvent("oom", 1, 1))
    assert hits == ["a", "b"]


@pytest.mark.timeout(10)
def test_representative_event_is_the_worst() -> None:
    """Decision.anomaly is the most severe event of the group (first among equals)."""
    policy = _policy(_rule("r", "{anomaly: oom}"))
    events = [
        AnomalyEvent("oom", 0, 1),
        AnomalyEvent("oom", 1, 1, severity="critical"),
        AnomalyEvent("oom", 2, 1, severity="critical"),
    ]
    (decision,) = Engine(policy).decide(events)
    assert decision.anomaly.rank == 1
    assert decision.ranks == (0, 1, 2)


@pytest.mark.timeout(10)
def test_group_by_kind_merges_steps() -> None:
    """group_by: [kind] makes one group of the same kind across steps in one tick slice."""
    policy = _policy(_rule("r", "{anomaly: oom}", extra="    group_by: [kind]\n"))
    events = [AnomalyEvent("oom", 0, 5, tick=9), AnomalyEvent("oom", 1, 6, tick=9)]
    assert len(Engine(policy).decide(events)) == 1


@pytest.mark.timeout(10)
def test_comparison_parsing() -> None:
    """Comparison strings parse strictly: operator, number; inf allowed."""
    assert parse_comparison(">= 1e-3") == Comparison(">=", 1e-3)
    assert parse_comparison("< inf").holds(5.0)
    assert parse_comparison("!= 0").describe() == "!= 0"


@pytest.mark.timeout(10)
def test_matcher_covers() -> None:
    """covers() is true only when one matcher is at least as broad as the other."""
    broad = Matcher(kinds=frozenset({"oom", "loss_spike"}))
    narrow = Matcher(kinds=frozenset({"oom"}), min_severity=2, ranks=frozenset({1}))
    assert broad.covers(narrow)
    assert not narrow.covers(broad)
    assert Matcher().covers(broad)
