"""Malformed report input is refused item by item and counted; it never costs a good item or a decision."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remedy.control.decide import Controller
from remedy.policies import AnomalyEvent, Engine, load_policy_text
from remedy.protocol.reports import MAX_INT, Limits, _bounded
from remedy.rundir.writer import RunDir, read_jsonl
from tests.supervisor.core.carried import Carried

POLICY = """
version: 1
name: validation-test
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 10, skip_batches: 0}
    cooldown_steps: 20
  - name: stalled
    when: {anomaly: data_stall}
    do: [notify]
"""


def make(tmp_path: Path, world_size: int = 1, **kwargs: Any) -> Controller:
    engine = Engine(load_policy_text(POLICY, "validation.yaml"), run_id="r")
    return Carried(engine, world_size=world_size, files=RunDir(tmp_path, "r"), **kwargs)


def nan(rank: int = 0, step: int = 5, **fields: Any) -> dict[str, Any]:
    ev = AnomalyEvent("nonfinite_loss", rank, step, value=math.nan, severity="critical")
    return {**ev.to_dict(), **fields}


def metric(step: int = 5, **fields: Any) -> dict[str, Any]:
    return {"step": step, "tick": step, "rank": 0, "loss": 1.5, "step_time_s": 0.01, **fields}


def batch(**fields: Any) -> dict[str, Any]:
    return {"rank": 0, "step": 6, "tick": 6, "events": [nan()], **fields}


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


# (label, the extra items of a batch that also holds one genuine NaN event, reason counted)
BAD_ITEMS: list[tuple[str, dict[str, Any], str]] = [
    ("event not a mapping", {"events": ["x", nan()]}, "event_invalid"),
    ("event unknown kind", {"events": [nan(kind="nonsense"), nan()]}, "event_invalid"),
    ("event kind unhashable", {"events": [nan(kind=[1]), nan()]}, "event_invalid"),
    ("event value 10**400", {"events": [nan(value=10**400), nan()]}, "event_invalid"),
    ("event step as text", {"events": [nan(step="5"), nan()]}, "event_invalid"),
    ("event unknown field", {"events": [nan(colour="red"), nan()]}, "event_invalid"),
    ("event of another rank", {"events": [nan(rank=7), nan()]}, "event_rank_mismatch"),
    ("event at step 10**30", {"events": [nan(step=10**30), nan()]}, "event_step_out_of_range"),
    ("event at tick 10**12", {"events": [nan(tick=10**12), nan()]}, "event_tick_out_of_range"),
    ("event after its batch", {"events": [nan(tick=7), nan()]}, "event_tick_out_of_range"),
    (
        "event details huge",
        {"events": [nan(details={"x": "y" * 100_000}), nan()]},
        "event_too_large",
    ),
    ("event details deep", {"events": [nan(details={"x": deep(5000)}), nan()]}, "event_too_large"),
    ("metrics loss 10**400", {"metrics": [metric(loss=10**400)]}, "metrics_invalid"),
    ("metrics not a mapping", {"metrics": ["garbage"]}, "metrics_invalid"),
    ("metrics step as text", {"metrics": [metric(step="abc")]}, "metrics_invalid"),
    ("metrics of another rank", {"metrics": [metric(rank=3)]}, "metrics_invalid"),
    ("metrics key not text", {"metrics": [{**metric(), 1: 2}]}, "metrics_invalid"),
    ("metrics not a list", {"metrics": "garbage"}, "metrics_not_list"),
    ("outcomes not a list", {"outcomes": {"decision_id": "x"}}, "outcomes_not_list"),
    (
        "outcome unhashable decision_id",
        {
            "outcomes": [
                {"decision_id": ["x"], "rank": 0, "outcome": "applied", "step": 5, "tick": 5}
            ]
        },
        "outcome_invalid",
    ),
    ("outcome missing fields", {"outcomes": [{"rank": 0}]}, "outcome_invalid"),
    (
        "outcome for no decision",
        {
            "outcomes": [
                {"decision_id": "nope", "rank": 0, "outcome": "applied", "step": 5, "tick": 5}
            ]
        },
        "outcome_unknown_decision",
    ),
    ("unknown batch field", {"colour": "red"}, "batch_unknown_field"),
]


@pytest.mark.parametrize(("label", "extra", "reason"), BAD_ITEMS, ids=[b[0] for b in BAD_ITEMS])
def test_a_bad_item_is_counted_and_the_good_event_decided(
    tmp_path: Path, label: str, extra: dict[str, Any], reason: str
) -> None:
    """The bad item is counted under its reason; the genuine NaN in the same batch is still decided."""
    controller = make(tmp_path)
    commands = controller.ingest(batch(**extra))
    assert dict(controller.rejected) == {reason: 1}, label
    assert [c["action"] for c in commands] == ["rollback"]
    assert controller.anomaly_counts == {"nonfinite_loss": 1}


# Batches whose header (rank, step, tick) is invalid: refused whole, and nothing changes.
BAD_HEADERS: list[tuple[str, Any, str]] = [
    ("not a mapping", ["rank", 0], "batch_not_mapping"),
    ("tick as text", batch(tick="abc"), "batch_bad_tick"),
    ("tick None", batch(tick=None), "batch_bad_tick"),
    ("tick a list", batch(tick=[1]), "batch_bad_tick"),
    ("tick 10**12", batch(tick=10**12), "batch_tick_too_far_ahead"),
    ("step 10**30", batch(step=10**30), "batch_bad_step"),
    ("step 10**12", batch(step=10**12), "batch_step_too_far_ahead"),
    ("step negative", batch(step=-1), "batch_bad_step"),
    ("rank a bool", batch(rank=True), "batch_bad_rank"),
    ("rank negative", batch(rank=-1), "batch_bad_rank"),
    ("rank outside the world", batch(rank=7), "batch_rank_outside_world"),
]


@pytest.mark.parametrize(("label", "bad", "reason"), BAD_HEADERS, ids=[b[0] for b in BAD_HEADERS])
def test_a_bad_header_refuses_the_batch_and_changes_nothing(
    tmp_path: Path, label: str, bad: Any, reason: str
) -> None:
    """The batch is counted under its reason and leaves no trace; the next good batch is decided as usual."""
    controller = make(tmp_path)
    assert controller.ingest(bad) == []
    assert dict(controller.rejected) == {reason: 1}, label
    assert (controller.step_of, controller.tick_of, controller.anomaly_counts) == ({}, {}, {})
    (command,) = controller.ingest(batch())
    assert command["apply_at_tick"] == 7  # the good batch's tick 6, plus the command lead


def test_phantom_rank_does_not_postpone_commands(tmp_path: Path) -> None:
    """A report from rank 7 with tick 10**12 in a 1-rank run is refused; the NaN rollback applies next step."""
    controller = make(tmp_path)
    for step in range(1, 5):
        controller.ingest({"rank": 0, "step": step, "tick": step})
    controller.ingest({"rank": 7, "step": 4, "tick": 10**12})
    (command,) = controller.ingest(batch())
    assert command["apply_at_tick"] == 7
    outcome = {"decision_id": command["decision_id"], "rank": 0, "outcome": "applied"}
    controller.ingest(
        {"rank": 0, "step": 7, "tick": 7, "outcomes": [{**outcome, "step": 7, "tick": 7}]}
    )
    (decision,) = read_jsonl(tmp_path / "decisions.jsonl")
    assert decision["outcome"] == "applied"
    assert controller.rejected == {"batch_rank_outside_world": 1}


def test_far_event_does_not_start_an_endless_cooldown(tmp_path: Path) -> None:
    """An event at step 10**30 is refused, so the rule still fires for the genuine NaN after it."""
    controller = make(tmp_path)
    controller.ingest({"rank": 0, "step": 3, "tick": 3, "events": [nan(step=10**30)]})
    assert [c["action"] for c in controller.ingest(batch())] == ["rollback"]
    assert [d["outcome"] for d in controller.decisions] == []  # pending, not suppressed
    assert controller.rejected == {"event_step_out_of_range": 1}


def test_a_flood_is_capped_per_batch_and_per_step(tmp_path: Path) -> None:
    """400k events in one batch: the caps bound what is read and written, the excess is counted."""
    controller = make(tmp_path, limits=Limits(max_events_per_batch=1000, max_events_per_tick=8))
    stall = AnomalyEvent("data_stall", 0, 5).to_dict()
    commands = controller.ingest(batch(events=[nan(), *[stall] * 400_000]))
    assert [c["action"] for c in commands] == ["rollback"]
    assert controller.rejected == {"events_over_batch_cap": 399_001, "events_over_tick_cap": 992}
    assert len(read_jsonl(tmp_path / "anomalies.jsonl")) == 8
    # The per-step cap holds across batches of the same tick, and a new tick has its own.
    controller.ingest({"rank": 0, "step": 6, "tick": 6, "events": [stall]})
    assert controller.rejected["events_over_tick_cap"] == 993
    controller.ingest(
        {"rank": 0, "step": 7, "tick": 7, "events": [{**stall, "step": 5, "tick": 5}]}
    )
    assert controller.rejected["events_over_tick_cap"] == 994
    controller.ingest(
        {"rank": 0, "step": 7, "tick": 7, "events": [{**stall, "step": 6, "tick": 6}]}
    )
    assert controller.rejected["events_over_tick_cap"] == 994


def test_restarted_rank_gets_a_fresh_per_step_cap(tmp_path: Path) -> None:
    """A rank whose ticks start again from 0 (a new process) is not held to its old process's counts."""
    controller = make(tmp_path, limits=Limits(max_events_per_tick=1))
    stall = AnomalyEvent("data_stall", 0, 2, tick=2).to_dict()
    controller.ingest({"rank": 0, "step": 3, "tick": 3, "events": [stall, stall]})
    controller.ingest({"rank": 0, "step": 40, "tick": 40})
    controller.ingest({"rank": 0, "step": 3, "tick": 3, "events": [stall]})
    assert controller.anomaly_counts["data_stall"] == 2
    assert controller.rejected == {"events_over_tick_cap": 1}


def test_going_back_is_allowed(tmp_path: Path) -> None:
    """Steps that go back after a rollback, with events from before it in the same batch, are accepted."""
    controller = make(tmp_path)
    controller.ingest({"rank": 0, "step": 100, "tick": 100})
    late = nan(step=105, tick=105)  # seen before the rollback, sent after it
    commands = controller.ingest({"rank": 0, "step": 91, "tick": 110, "events": [late]})
    assert [c["action"] for c in commands] == ["rollback"]
    assert controller.rejected == {}


def test_a_fast_rank_is_not_locked_out(tmp_path: Path) -> None:
    """The bound on steps ahead grows with the time since the rank's last report."""
    now = [1000.0]
    limits = Limits(max_ahead=10, ahead_per_s=1000)
    controller = make(tmp_path, limits=limits, started=now[0])
    controller.ingest({"rank": 0, "step": 1, "tick": 1}, now=now[0])
    controller.ingest({"rank": 0, "step": 500, "tick": 500}, now=now[0])
    assert controller.rejected == {"batch_step_too_far_ahead": 1}
    now[0] += 1.0  # a second later, 1010 steps ahead are within reach
    controller.ingest({"rank": 0, "step": 1012, "tick": 1012}, now=now[0])
    assert controller.rejected == {"batch_step_too_far_ahead": 2}
    controller.ingest({"rank": 0, "step": 1011, "tick": 1011}, now=now[0])
    assert controller.rejected == {"batch_step_too_far_ahead": 2}
    assert controller.step_of[0] == 1011


def test_a_batch_stamped_with_its_runs_token_counts_no_unknown_field(tmp_path: Path) -> None:
    """`token` is a batch field (the supervisor checks it); it is not counted as unknown."""
    c = make(tmp_path)
    c.ingest({"rank": 0, "step": 1, "tick": 1, "token": "0" * 32, "seq": 1, "incarnation": 1})
    assert dict(c.rejected) == {}


class _Str(str):
    """A str subclass, as unpickling can hand the validator."""


_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**60), 2**60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.text(max_size=6).map(_Str),
    st.sampled_from(["x" * 40, b"bytes", (1, 2), {1, 2}, 2**53, -(2**53)]),
)
_DATA = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 3)), inner, max_size=6),
    ),
    max_leaves=40,
)


def _bounded_reference(value: Any, limits: Limits) -> bool:
    """The definition: one walk over every node with isinstance checks."""
    budget, stack = limits.max_nodes, [value]
    while stack:
        budget -= 1
        if budget < 0:
            return False
        item = stack.pop()
        if item is None or isinstance(item, bool | float):
            continue
        if isinstance(item, int):
            if abs(item) >= MAX_INT:
                return False
        elif isinstance(item, str):
            if len(item) > limits.max_text:
                return False
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if not all(isinstance(k, str) and len(k) <= limits.max_text for k in item):
                return False
            stack.extend(item.values())
        else:
            return False
    return True


@settings(max_examples=400, deadline=None)
@given(_DATA, st.integers(1, 30), st.integers(1, 50))
def test_bounded_fast_path_agrees_with_the_definition(value: Any, nodes: int, text: int) -> None:
    """The in-place check of a mapping's scalars accepts exactly what the plain walk accepts."""
    limits = Limits(max_nodes=nodes, max_text=text)
    assert _bounded(value, limits) is _bounded_reference(value, limits)
