"""One fault seen on several ranks or through a collective reaches the policy as one incident."""

from __future__ import annotations

import pytest

from remedy.policies import AnomalyEvent, Engine, IncidentMerger, load_policy, merged_text


def _ev(kind: str, rank: int, tick: int = 7) -> AnomalyEvent:
    return AnomalyEvent(kind=kind, rank=rank, step=tick, tick=tick, severity="critical")


@pytest.mark.parametrize("first", ["nonfinite_grad", "nonfinite_loss"])
def test_ddp_nan_is_one_incident_whichever_rank_reports_first(first: str) -> None:
    """NaN loss on rank 1, NaN grads on both: held until both reported, then one nonfinite_loss
    that names every other event, whichever rank's report came first."""
    merger = IncidentMerger(world_size=2)
    batches = {
        "nonfinite_grad": (0, [_ev("nonfinite_grad", 0)]),
        "nonfinite_loss": (1, [_ev("nonfinite_loss", 1), _ev("nonfinite_grad", 1)]),
    }
    order = [first, next(k for k in batches if k != first)]
    ticks: dict[int, int] = {}
    rank, events = batches[order[0]]
    ticks[rank] = 8
    # Nothing is decided while the other rank has not reported the tick, the cause included.
    assert merger.offer(events, ticks=ticks, now=0.0) == []
    assert merger.holding == len(events)
    rank, events = batches[order[1]]
    ticks[rank] = 8
    (incident,) = merger.offer(events, ticks=ticks, now=0.1)
    assert (incident.kind, incident.rank) == ("nonfinite_loss", 1)
    assert sorted((m["kind"], m["rank"]) for m in incident.details["merged"]) == [
        ("nonfinite_grad", 0),
        ("nonfinite_grad", 1),
    ]
    assert "nonfinite_grad on rank 0" in (merged_text(incident.to_dict()) or "")
    assert merger.late == []


def test_a_rank_that_went_quiet_holds_the_cause_at_most_hold_s() -> None:
    """The NaN-loss rank reported, its peer never does: the cause is decided after hold_s."""
    merger = IncidentMerger(world_size=2, hold_s=1.0)
    assert merger.offer([_ev("nonfinite_loss", 1)], ticks={1: 8}, now=0.0) == []
    assert merger.offer([], ticks={1: 9}, now=0.5) == []
    (incident,) = merger.offer([], ticks={1: 10}, now=1.0)
    assert (incident.kind, incident.rank) == ("nonfinite_loss", 1)
    assert "merged" not in incident.details


def test_default_policy_decides_one_chain_for_the_merged_incident() -> None:
    """The default policy sees one event: one rollback chain with its x0.8 cut, no x0.5 cut."""
    engine = Engine(load_policy("default"), run_id="t")
    merger = IncidentMerger(world_size=2)
    ticks = {0: 8, 1: 8}
    events = merger.offer(
        [_ev("nonfinite_grad", 0), _ev("nonfinite_loss", 1), _ev("nonfinite_grad", 1)],
        ticks=ticks,
        now=0.0,
    )
    decisions = engine.decide(events, now=0.0)
    assert [(d.action, d.params.get("factor")) for d in decisions] == [
        ("rollback", None),
        ("shrink_lr", 0.8),
    ]


def test_a_late_report_of_a_decided_tick_is_not_decided_again() -> None:
    """A rank that went quiet: released after hold_s; its late event joins the decided incident."""
    merger = IncidentMerger(world_size=2, hold_s=1.0)
    assert merger.offer([_ev("nonfinite_grad", 0)], ticks={0: 8}, now=0.0) == []
    (incident,) = merger.offer([], ticks={0: 9}, now=1.5)
    assert incident.kind == "nonfinite_grad"
    assert merger.offer([_ev("nonfinite_grad", 1)], ticks={0: 9, 1: 8}, now=1.6) == []
    assert merger.late[0][1] is incident


def test_other_kinds_and_other_ticks_pass_through_apart() -> None:
    """A loss spike is not held; NaNs at two ticks are two incidents; one rank is never held."""
    merger = IncidentMerger(world_size=1)
    spike = _ev("loss_spike", 0)
    out = merger.offer(
        [spike, _ev("nonfinite_loss", 0, tick=3), _ev("nonfinite_loss", 0, tick=5)],
        ticks={0: 6},
        now=0.0,
    )
    assert [(e.kind, e.tick) for e in out] == [
        ("loss_spike", 7),
        ("nonfinite_loss", 3),
        ("nonfinite_loss", 5),
    ]
    assert merger.holding == 0
    assert merger.flush() == []
