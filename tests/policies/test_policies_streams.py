"""The compact stream notation and rank keys."""

from __future__ import annotations

import math

import pytest

from remedy.policies import PolicyTestError
from remedy.policies._streams import parse_pattern, parse_ranks


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("_x3 1x2", [None, None, None, 1.0, 1.0]),
        ("5.0e4 _ -2", [5.0e4, None, -2.0]),
        ("", []),
        ("  1   _  ", [1.0, None]),
        ("infx2", [math.inf, math.inf]),
    ],
)
@pytest.mark.timeout(10)
def test_parse_pattern(pattern: str, expected: list[float | None]) -> None:
    """Tokens expand to one entry per step."""
    assert parse_pattern(pattern) == expected


@pytest.mark.timeout(10)
def test_parse_pattern_nan() -> None:
    """nan is a value (a non-finite reading)."""
    (value,) = parse_pattern("nan")
    assert value is not None
    assert math.isnan(value)


@pytest.mark.parametrize("bad", ["x3", "1x", "abc", "_x-1", "1,2"])
@pytest.mark.timeout(10)
def test_bad_tokens(bad: str) -> None:
    """Anything outside the grammar is an error that shows an example."""
    with pytest.raises(PolicyTestError, match="expected _ or a number"):
        parse_pattern(bad)


@pytest.mark.parametrize(
    ("key", "ranks"), [("rank0", [0]), ("rank2-4", [2, 3, 4]), ("ranks 0-1", [0, 1])]
)
@pytest.mark.timeout(10)
def test_parse_ranks(key: str, ranks: list[int]) -> None:
    """Stream keys name one rank or a range."""
    assert parse_ranks(key) == ranks


@pytest.mark.parametrize("bad", ["node0", "rank", "rank3-1"])
@pytest.mark.timeout(10)
def test_bad_rank_keys(bad: str) -> None:
    """Other keys are errors."""
    with pytest.raises(PolicyTestError):
        parse_ranks(bad)
