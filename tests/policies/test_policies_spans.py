"""Spans: the strict grammar of windows and cooldowns."""

from __future__ import annotations

import pytest
from pydantic_core import PydanticCustomError

from remedy.policies._spans import Span, parse_span


@pytest.mark.parametrize(
    ("text", "span"),
    [
        (500, Span(500.0, "steps")),
        ("500", Span(500.0, "steps")),
        ("500 steps", Span(500.0, "steps")),
        ("1 step", Span(1.0, "steps")),
        ("30s", Span(30.0, "seconds")),
        ("10m", Span(600.0, "seconds")),
        ("2h", Span(7200.0, "seconds")),
        ("1.5h", Span(5400.0, "seconds")),
        ("1d", Span(86400.0, "seconds")),
        ("250ms", Span(0.25, "seconds")),
    ],
)
@pytest.mark.timeout(10)
def test_parse(text: object, span: Span) -> None:
    """Step counts and durations parse to their span."""
    assert parse_span(text) == span


@pytest.mark.parametrize(
    "bad", ["10 minutes", "-5", -5, "5x", "m", True, None, 1.5, "5 steps later"]
)
@pytest.mark.timeout(10)
def test_rejects(bad: object) -> None:
    """Everything else is refused with the grammar in the message."""
    with pytest.raises(PydanticCustomError):
        parse_span(bad)


@pytest.mark.timeout(10)
def test_describe_and_scale() -> None:
    """Spans describe themselves and scale with a cap (back-off)."""
    assert Span(600.0, "seconds").describe() == "10m"
    assert Span(1.0, "steps").describe() == "1 step"
    assert Span(10.0, "steps").scaled(2.5, None) == Span(25.0, "steps")
    assert Span(10.0, "steps").scaled(8, Span(50.0, "steps")) == Span(50.0, "steps")
    assert Span(90.0, "seconds").to_json() == "90s"
