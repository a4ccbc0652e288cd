"""`AnomalyEvent.from_dict` rejects every malformed input with `EventError` and a reason."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remedy.policies import EVENT_REJECT_REASONS, MAX_STEP, AnomalyEvent, EventError

GOOD: dict[str, Any] = {"kind": "loss_spike", "rank": 0, "step": 5, "value": 3.0}

BAD: list[tuple[str, Any, str]] = [
    ("a list", [1, 2], "not_a_mapping"),
    ("a string", "loss_spike", "not_a_mapping"),
    ("None", None, "not_a_mapping"),
    ("unknown field", GOOD | {"colour": 1}, "unknown_field"),
    ("non-string field", {**GOOD, 7: 1}, "unknown_field"),
    ("unknown kind", GOOD | {"kind": "bad_vibes"}, "unknown_kind"),
    ("unhashable kind", GOOD | {"kind": ["loss_spike"]}, "unknown_kind"),
    ("missing kind", {"rank": 0, "step": 1}, "unknown_kind"),
    ("rank as text", GOOD | {"rank": "0"}, "bad_rank"),
    ("negative rank", GOOD | {"rank": -1}, "bad_rank"),
    ("huge rank", GOOD | {"rank": 10**30}, "bad_rank"),
    ("missing step", {"kind": "loss_spike", "rank": 0}, "bad_step"),
    ("step abc", GOOD | {"step": "abc"}, "bad_step"),
    ("step None", GOOD | {"step": None}, "bad_step"),
    ("step [1]", GOOD | {"step": [1]}, "bad_step"),
    ("step True", GOOD | {"step": True}, "bad_step"),
    ("step 1.5", GOOD | {"step": 1.5}, "bad_step"),
    ("step nan", GOOD | {"step": float("nan")}, "bad_step"),
    ("step -3", GOOD | {"step": -3}, "bad_step"),
    ("step 10**30", GOOD | {"step": 10**30}, "bad_step"),
    ("step MAX+1", GOOD | {"step": MAX_STEP + 1}, "bad_step"),
    ("step 10**5000", GOOD | {"step": 10**5000}, "bad_step"),
    ("tick abc", GOOD | {"tick": "abc"}, "bad_tick"),
    ("tick [1]", GOOD | {"tick": [1]}, "bad_tick"),
    ("tick False", GOOD | {"tick": False}, "bad_tick"),
    ("tick 2.0", GOOD | {"tick": 2.0}, "bad_tick"),
    ("tick 10**30", GOOD | {"tick": 10**30}, "bad_tick"),
    ("value 10**400", GOOD | {"value": 10**400}, "bad_value"),
    ("value text", GOOD | {"value": "big"}, "bad_value"),
    ("value list", GOOD | {"value": [1.0]}, "bad_value"),
    ("value True", GOOD | {"value": True}, "bad_value"),
    ("threshold 10**400", GOOD | {"threshold": 10**400}, "bad_threshold"),
    ("threshold dict", GOOD | {"threshold": {}}, "bad_threshold"),
    ("severity unknown", GOOD | {"severity": "dire"}, "bad_severity"),
    ("severity unhashable", GOOD | {"severity": ["warning"]}, "bad_severity"),
    ("source unhashable", GOOD | {"source": {"a": 1}}, "bad_source"),
    ("ts text", GOOD | {"ts": "now"}, "bad_ts"),
    ("ts inf", GOOD | {"ts": float("inf")}, "bad_ts"),
    ("ts nan", GOOD | {"ts": "nan"}, "bad_ts"),
    ("ts negative", GOOD | {"ts": -1.0}, "bad_ts"),
    ("ts 10**400", GOOD | {"ts": 10**400}, "bad_ts"),
    ("details list", GOOD | {"details": [1]}, "bad_details"),
    ("details unserialisable", GOOD | {"details": {"x": object()}}, "bad_details"),
    ("details int keys", GOOD | {"details": {1: 2}}, "bad_details"),
    ("details huge", GOOD | {"details": {"x": "y" * 10_000}}, "bad_details"),
    ("details huge int", GOOD | {"details": {"x": 10**5000}}, "bad_details"),
]


@pytest.mark.parametrize(("name", "data", "reason"), BAD, ids=[b[0] for b in BAD])
def test_malformed_event_is_rejected_with_its_reason(name: str, data: Any, reason: str) -> None:
    """Each malformed shape raises EventError (nothing else), with its machine-readable reason."""
    with pytest.raises(EventError) as info:
        AnomalyEvent.from_dict(data)
    assert info.value.reason == reason
    assert info.value.reason in EVENT_REJECT_REASONS
    assert len(str(info.value)) < 800


def test_deeply_nested_details_are_rejected() -> None:
    """A details value nested 100,000 deep is refused, not a RecursionError."""
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(EventError) as info:
        AnomalyEvent.from_dict(GOOD | {"details": {"x": deep}})
    assert info.value.reason == "bad_details"


def test_event_error_pickles_with_its_reason() -> None:
    """EventError crosses Ray boundaries with its message and reason."""
    err = pickle.loads(pickle.dumps(EventError("step must be ...", "bad_step")))
    assert (str(err), err.reason) == ("step must be ...", "bad_step")


def test_good_events_round_trip() -> None:
    """A valid event, its largest step included, survives to_dict/from_dict."""
    event = AnomalyEvent.from_dict(GOOD | {"step": MAX_STEP, "value": "inf", "details": {"a": 1}})
    assert AnomalyEvent.from_dict(event.to_dict()) == event


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**500), max_value=10**500)
    | st.floats()
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["kind", "rank", "step", "tick", "value", "threshold", "severity", "source", "ts", "details"]
)
field_values = json_values | st.sampled_from(["loss_spike", "warning", "detector", "nan", 0, 5])


@settings(max_examples=600, deadline=None)
@given(
    data=st.dictionaries(field_names | st.text(max_size=5), field_values, max_size=10) | json_values
)
def test_any_input_gives_an_event_or_event_error(data: Any) -> None:
    """Random JSON-like input: a valid event or EventError with a known reason, never another error."""
    reason = None
    try:
        event = AnomalyEvent.from_dict(data)
    except EventError as exc:
        reason = exc.reason
    if reason is not None:
        assert reason in EVENT_REJECT_REASONS
    else:
        assert 0 <= event.step <= MAX_STEP and 0 <= event.tick <= MAX_STEP
