"""The escalation ladder: an incident that a rewind does not cure climbs rung by rung to a stop."""

from __future__ import annotations

import pytest

from remedy.policies import AnomalyEvent, Decision, Engine, load_policy, load_policy_text
from remedy.policies._ladder import REPEATS, RUNGS, STOP, Ladder, rung_steps
from remedy.policies._rules import Step, freeze

ROLLBACK = (
    Step("rollback", freeze({"steps_back": 30, "skip_batches": 10})),
    Step("shrink_lr", freeze({"factor": 0.8})),
)


def _event(kind: str = "nonfinite_loss", step: int = 60, tick: int = 60, rank: int = 0):
    return AnomalyEvent(kind, rank, step, tick=tick, severity="critical")


# ------------------------------------------------------------------ the pure ladder
def test_a_chain_that_does_not_rewind_starts_no_incident() -> None:
    """Only a rewind (rollback, restart_rank) can bring a step back: nothing else is tracked."""
    ladder = Ladder()
    lr = (Step("shrink_lr", freeze({"factor": 0.5})),)
    assert ladder.remedied(_event(), tick=60, rule="r", chain="c", steps=lr) is None
    assert ladder.sighting(_event(tick=90), tick=90) is None


def test_unknown_incidents_are_left_to_the_policy() -> None:
    """Another kind, or the same kind at another step, is no sighting of the incident."""
    ladder = Ladder()
    ladder.remedied(_event(), tick=60, rule="r", chain="c", steps=ROLLBACK)
    assert ladder.sighting(_event(step=61, tick=91), tick=91) is None
    assert ladder.sighting(_event(kind="loss_spike", tick=91), tick=91) is None


def test_a_report_of_the_same_sighting_while_the_rewind_runs_is_not_counted() -> None:
    """Until the rewind has an outcome, a report at no later tick is the same sighting."""
    ladder = Ladder()
    inc = ladder.remedied(_event(), tick=60, rule="r", chain="c", steps=ROLLBACK)
    assert inc is not None
    move = ladder.sighting(_event(rank=1), tick=60)
    assert move is not None and not move.act
    assert inc.sightings == 1


@pytest.mark.parametrize("repeats", [2, 3, 4])
def test_each_rung_is_tried_until_seen_repeats_times_then_climbs(repeats: int) -> None:
    """Seen `repeats` times on one rung, the incident climbs; after the stop rung, nothing."""
    ladder = Ladder(repeats=repeats)
    inc = ladder.remedied(_event(), tick=60, rule="r", chain="c0", steps=ROLLBACK)
    assert inc is not None
    rungs = [0]
    tick = 60
    for n in range(100):
        ladder.resolved(inc.chain, "rollback", "applied", "")
        tick += 30
        move = ladder.sighting(_event(tick=tick), tick=tick)
        assert move is not None
        if not move.act:
            break
        rungs.append(move.rung)
        ladder.issued(inc, f"c{n + 1}")
    expected = [r for r in range(STOP) for _ in range(repeats - 1)] + [STOP]
    assert rungs == expected
    assert inc.rung == STOP


def test_the_climb_says_why_and_what_comes_next() -> None:
    """The move's sentence names the rung left, the sightings, and the rung climbed to."""
    ladder = Ladder()
    inc = ladder.remedied(_event(), tick=60, rule="r", chain="c", steps=ROLLBACK)
    assert inc is not None
    moves = []
    for tick in (90, 120):
        ladder.resolved(inc.chain, "rollback", "applied", "")
        move = ladder.sighting(_event(tick=tick), tick=tick)
        assert move is not None
        moves.append(move)
        ladder.issued(inc, f"c{tick}")
    assert (
        not moves[0].climbed
        and "came back after rung 0 (policy): seen 2 of 3 times" in moves[0].why
    )
    assert moves[1].climbed and moves[1].rung == 1
    assert "seen 3 times on rung 0" in moves[1].why
    assert RUNGS[1].text in moves[1].why
    assert moves[1].details() == {
        "incident": "nonfinite_loss at step 60",
        "rung": 1,
        "rungs": STOP,
        "name": "durable",
        "seen": 1,
        "sightings": 3,
        "climbed": True,
    }


@pytest.mark.parametrize("rung", [1, 2, 3])
def test_a_failed_rung_climbs_at_once(rung: int) -> None:
    """A rung that cannot be carried out (no durable checkpoint) gives way to the next."""
    ladder = Ladder()
    inc = ladder.remedied(_event(), tick=60, rule="r", chain="c", steps=ROLLBACK)
    assert inc is not None
    inc.rung = rung
    move = ladder.resolved("c", "rollback", "failed", "no checkpoint")
    assert move is not None and move.act and move.climbed
    assert move.rung == rung + 1
    assert f"rung {rung} ({RUNGS[rung].name}) failed: no checkpoint" in move.why


def test_a_failed_policy_remedy_is_left_to_its_rule() -> None:
    """Rung 0 is the policy's own chain: its `on_failure` says what follows, not the ladder."""
    ladder = Ladder()
    ladder.remedied(_event(), tick=60, rule="r", chain="c", steps=ROLLBACK)
    assert ladder.resolved("c", "rollback", "failed", "") is None
    assert ladder.resolved("c", "shrink_lr", "failed", "") is None


def test_rung_steps_strengthen_the_rollback() -> None:
    """Memory (the policy's), durable, older durable, a skipped range, then notify and abort."""
    ladder = Ladder()
    inc = ladder.remedied(_event(), tick=60, rule="r", chain="c", steps=ROLLBACK)
    assert inc is not None
    assert rung_steps(inc, 0, ROLLBACK) == ROLLBACK
    one, two, three = (rung_steps(inc, r, ROLLBACK) for r in (1, 2, 3))
    assert dict(one[0].params) == {"steps_back": 30, "skip_batches": 10, "source": "disk"}
    assert dict(two[0].params) == {
        "steps_back": 30,
        "skip_batches": 10,
        "source": "disk",
        "older": 1,
    }
    assert dict(three[0].params) == {"steps_back": 30, "skip_batches": 70}
    stop = rung_steps(inc, STOP, ROLLBACK)
    assert [s.action for s in stop] == ["notify", "abort"]
    assert "came back after every rung" in stop[1].params["reason"]
    # Without the policy's rule (a reloaded policy), rung 0 is the durable rung.
    assert rung_steps(inc, 0, None) == one


def test_a_rank_restart_incident_restarts_the_rank_on_every_rollback_rung() -> None:
    """A rank lost again at the same step: its rungs restart it, then roll back."""
    ladder = Ladder()
    restart = (Step("restart_rank", freeze({})),)
    inc = ladder.remedied(_event("rank_dead"), tick=60, rule="r", chain="c", steps=restart)
    assert inc is not None and inc.restart
    for rung in (1, 2, 3):
        assert [s.action for s in rung_steps(inc, rung, restart)] == ["restart_rank", "rollback"]
    assert [s.action for s in rung_steps(inc, STOP, restart)] == ["notify", "abort"]


def test_a_rank_kind_is_one_incident_per_rank() -> None:
    """Two ranks lost at one step are two incidents; the same rank lost there again is one."""
    ladder = Ladder()
    restart = (Step("restart_rank", freeze({})),)
    ladder.remedied(_event("rank_dead", rank=1), tick=60, rule="r", chain="c", steps=restart)
    assert ladder.sighting(_event("rank_dead", rank=3, tick=60), tick=60) is None
    ladder.resolved("c", "restart_rank", "applied", "")
    move = ladder.sighting(_event("rank_dead", rank=1, tick=60), tick=60)
    assert move is not None and move.act and move.incident.name == "rank_dead at step 60 on rank 1"


def test_state_round_trips() -> None:
    """`to_dict` / `from_dict` keep every incident and its rung; None is an empty ladder."""
    ladder = Ladder()
    inc = ladder.remedied(_event(), tick=60, rule="r", chain="c", steps=ROLLBACK)
    assert inc is not None
    inc.rung, inc.seen = 2, 2
    back = Ladder.from_dict(ladder.to_dict())
    assert back.to_dict() == ladder.to_dict()
    assert Ladder.from_dict(None).incidents == {}


# ------------------------------------------------------------------ through the engine
def _climb(engine: Engine, kind: str = "nonfinite_loss", step: int = 60, times: int = 12):
    """Feed the same incident `times` times, each at a later tick, every decision applied
    (or failed, for a rollback to disk when `fail_disk`); the decisions of each sighting."""
    out: list[list[Decision]] = []
    tick = step
    for _ in range(times):
        decisions = engine.decide([AnomalyEvent(kind, 0, step, tick=tick, severity="critical")])
        out.append(decisions)
        for d in decisions:
            if not d.suppressed and d.action not in ("notify", "abort"):
                engine.record_outcome(d.decision_id, "applied", tick=tick)
        tick += 40
    return out


def test_default_policy_nan_at_one_step_climbs_every_rung_then_stops() -> None:
    """A NaN loss at step 60 after every rollback: the rungs in order, then notify and abort."""
    engine = Engine(load_policy("default"))
    rounds = _climb(engine, times=12)
    acted = [[d for d in r if not d.suppressed] for r in rounds]
    rollbacks = [[d for d in r if d.action == "rollback"] for r in acted]
    sources = [r[0].params.get("source", "auto") if r else None for r in rollbacks]
    assert sources[:8] == ["auto", "auto", "disk", "disk", "disk", "disk", "auto", "auto"]
    assert [r[0].params.get("older", 0) for r in rollbacks[2:6]] == [0, 0, 1, 1]
    assert rollbacks[6][0].params["skip_batches"] == 70
    assert [d.action for d in acted[8]] == ["notify", "abort"]
    assert "came back after every rung" in acted[8][1].params["reason"]
    assert all(not r for r in acted[9:]), "nothing after the stop"
    # Every rung's decision is the policy rule's, and its anomaly names the rung.
    rungs = [r[0].anomaly.details.get("ladder", {}).get("rung", 0) for r in acted[:9]]
    assert rungs == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    assert {d.rule for r in acted[:9] for d in r} == {"nan-rollback"}
    assert "escalation ladder for rule 'nan-rollback'" in acted[2][0].reason
    # The policy's own remedy (rollback + LR cut) is repeated on rung 0.
    assert [d.action for d in acted[1]] == ["rollback", "shrink_lr"]


def test_a_failed_durable_rung_climbs_in_the_same_outcome() -> None:
    """Under the callbacks no durable checkpoint exists: rungs 1 and 2 fail and the skip follows."""
    engine = Engine(load_policy("default"))
    tick = 60
    seen: list[int] = []
    actions: list[str] = []
    for _ in range(8):
        todo = engine.decide([AnomalyEvent("nonfinite_loss", 0, 60, tick=tick)])
        while todo:
            d = todo.pop(0)
            if d.suppressed:
                continue
            actions.append(d.action)
            seen.append(d.anomaly.details.get("ladder", {}).get("rung", 0))
            if d.action in ("notify", "abort"):
                continue
            failed = d.params.get("source") == "disk"
            todo += engine.record_outcome(
                d.decision_id, "failed" if failed else "applied", tick=tick, detail="no store"
            )
        tick += 40
    assert seen == [0, 0, 0, 0, 1, 2, 3, 3, 4, 4]
    assert actions[-2:] == ["notify", "abort"]


def test_the_rule_never_exhausts_on_a_recurring_incident() -> None:
    """The ladder answers the recurrences: nan-rollback's max_fires=3 does not abort at once."""
    engine = Engine(load_policy("default"))
    rounds = _climb(engine, times=4)
    assert not any(d.action == "abort" for r in rounds for d in r)


def test_on_rung_0_the_rules_cooldown_holds_a_sighting_back_and_it_still_counts() -> None:
    """A recurrence inside nan-rollback's 20-step cooldown is suppressed by the rule, saying
    so; it is a sighting all the same, and the next one climbs to rung 1."""
    engine = Engine(load_policy("default"))
    first = engine.decide([AnomalyEvent("nonfinite_loss", 0, 60, tick=60)])
    for d in first:
        engine.record_outcome(d.decision_id, "applied", tick=60)
    held = engine.decide([AnomalyEvent("nonfinite_loss", 0, 60, tick=70)])
    assert [(d.action, d.suppressed) for d in held] == [("rollback", True)]
    assert "cooling down" in held[0].reason
    assert held[0].anomaly.details["ladder"] == {
        "incident": "nonfinite_loss at step 60",
        "rung": 0,
        "rungs": STOP,
        "name": "policy",
        "seen": 2,
        "sightings": 2,
        "climbed": False,
    }
    climbed = engine.decide([AnomalyEvent("nonfinite_loss", 0, 60, tick=200)])
    assert climbed[0].params["source"] == "disk"
    assert climbed[0].anomaly.details["ladder"]["rung"] == 1


def test_a_new_incident_at_another_step_goes_to_the_policy() -> None:
    """A NaN at another step is the policy's (cooldown, max_fires), not the ladder's."""
    engine = Engine(load_policy("default"))
    _climb(engine, times=3)
    other = engine.decide([AnomalyEvent("nonfinite_loss", 0, 75, tick=400)])
    assert [d.action for d in other] == ["rollback", "shrink_lr"]
    assert "ladder" not in other[0].anomaly.details


def test_rank_lost_at_the_same_step_climbs_with_restarts() -> None:
    """A rank that dies at the same step after each restart and rollback: bounded, then stop."""
    engine = Engine(load_policy("default"))
    rounds = _climb(engine, kind="rank_dead", step=50, times=10)
    acted = [[d.action for d in r if not d.suppressed] for r in rounds]
    assert acted[0] == ["restart_rank"]
    assert acted[2] == ["restart_rank", "rollback"]
    assert ["notify", "abort"] in acted


def test_engine_state_keeps_the_ladder() -> None:
    """A restarted supervisor resumes the incident on its rung, not from the policy again."""
    engine = Engine(load_policy("default"))
    _climb(engine, times=3)
    again = Engine(load_policy("default"))
    again.load_state_dict(engine.state_dict())
    d = again.decide([AnomalyEvent("nonfinite_loss", 0, 60, tick=1000)])
    assert d[0].anomaly.details["ladder"]["rung"] == 1


def test_a_policy_without_rewinds_never_climbs() -> None:
    """An LR-cut-only rule on a fault that comes back at one step: its own limits decide."""
    engine = Engine(
        load_policy_text(
            "version: 1\nrules:\n  - name: lr\n    when: {anomaly: nonfinite_loss}\n"
            "    do: [shrink_lr]\n"
        )
    )
    rounds = _climb(engine, times=5)
    assert all("ladder" not in d.anomaly.details for r in rounds for d in r)


def test_repeats_default_is_three() -> None:
    """The rule of the issue: seen 3 times on one rung climbs."""
    assert REPEATS == 3


def test_older_without_source_disk_is_a_located_error() -> None:
    """A policy's rollback with `older` but no `source: disk` is refused at its line."""
    from remedy.policies import PolicyError  # noqa: PLC0415

    text = (
        "version: 1\nrules:\n  - name: a\n    when: {anomaly: nonfinite_loss}\n"
        "    do:\n      - rollback: {steps_back: 10, older: 1}\n"
    )
    with pytest.raises(PolicyError, match=r"p\.yaml:6:.*add `source: disk`"):
        load_policy_text(text, "p.yaml")
    ok = load_policy_text(text.replace("older: 1}", "older: 1, source: disk}"), "p.yaml")
    assert dict(ok.rules[0].steps[0].params) == {
        "steps_back": 10,
        "skip_batches": 0,
        "source": "disk",
        "older": 1,
    }
