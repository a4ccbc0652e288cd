"""Validated scalar types for policy models, with messages that say what is allowed.

Each type is a pydantic `PlainValidator`, so a wrong type and an
out-of-range number both get one message naming the allowed range
("must be a number with 0 < factor < 1, got 1.5") instead of pydantic's
generic text. Names (anomaly kinds, actions, severities) are checked against
the closed vocabularies with a "did you mean" suggestion.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any

from pydantic import PlainValidator
from pydantic_core import PydanticCustomError

from remedy.policies._vocab import ACTIONS, ANOMALY_KINDS, SEVERITIES, SOURCES


def suggest(word: str, choices: Sequence[str]) -> str:
    """A " did you mean 'x'?" suffix, or "" when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _range_text(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    lo_op, hi_op = ("<" if lo_open else "<="), ("<" if hi_open else "<=")
    if lo is not None and hi is not None:
        return f"with {lo:g} {lo_op} x {hi_op} {hi:g}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{hi_op} {hi:g}"
    return ""


MAX_POLICY_INT = 10**9  # no count, limit or size in a policy is larger


def number_validator(
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    integer: bool = False,
    optional: bool = False,
) -> Callable[[Any], Any]:
    """Build a validator for a bounded int or float (optionally allowing null)."""
    kind = "an integer" if integer else "a number"
    allowed = f"{kind} {_range_text(lo, hi, lo_open, hi_open)}".rstrip()
    if optional:
        allowed += " (or null)"

    def check(value: Any) -> Any:
        if value is None and optional:
            return None
        ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
        if isinstance(value, bool) or not ok_type:
            raise PydanticCustomError("number", f"expected {allowed}, got {value!r}")
        if not integer and not math.isfinite(value):
            raise PydanticCustomError("number", f"expected a finite value: {allowed}, got {value}")
        if integer and not -MAX_POLICY_INT <= value <= MAX_POLICY_INT:
            raise PydanticCustomError(
                "range", f"out of range: expected {allowed} and at most {MAX_POLICY_INT}"
            )
        too_low = lo is not None and (value <= lo if lo_open else value < lo)
        too_high = hi is not None and (value >= hi if hi_open else value > hi)
        if too_low or too_high:
            raise PydanticCustomError("range", f"out of range: expected {allowed}, got {value!r}")
        return value if integer else float(value)

    return check


def name_validator(choices: Sequence[str], noun: str) -> Callable[[Any], str]:
    """Build a validator that accepts one of `choices`, suggesting the closest on a typo."""

    def check(value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        hint = suggest(value, choices) if isinstance(value, str) else ""
        raise PydanticCustomError(
            "unknown_name",
            f"unknown {noun} {value!r}{hint} (valid: {', '.join(choices)})",
        )

    return check


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise PydanticCustomError("bool", f"expected true or false, got {value!r}")


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise PydanticCustomError("text", f"expected a string, got {value!r}")


NonNegInt = Annotated[int, PlainValidator(number_validator(lo=0, integer=True))]
PosInt = Annotated[int, PlainValidator(number_validator(lo=1, integer=True))]
NonNegFloat = Annotated[float, PlainValidator(number_validator(lo=0))]
Bool = Annotated[bool, PlainValidator(_bool)]
Text = Annotated[str, PlainValidator(_text)]
AnomalyKind = Annotated[str, PlainValidator(name_validator(ANOMALY_KINDS, "anomaly kind"))]
ActionName = Annotated[str, PlainValidator(name_validator(ACTIONS, "action"))]
SeverityName = Annotated[str, PlainValidator(name_validator(SEVERITIES, "severity"))]
SourceName = Annotated[str, PlainValidator(name_validator(SOURCES, "source"))]
