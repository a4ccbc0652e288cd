"""Spans: how long a window, cooldown or back-off lasts.

A span is counted either in steps (``500``, ``"500 steps"``) or in wall-clock
time (``"30s"``, ``"10m"``, ``"2h"``, ``"1d"``). The grammar is strict: one
non-negative number and one unit, nothing else, so a typo is an error rather
than a silently different window. Steps are measured in ticks (executed
steps, which keep growing across rollbacks); durations in event timestamps.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic_core import PydanticCustomError

Unit = Literal["steps", "seconds"]

_STEPS_RE = re.compile(r"(?P<n>\d+)(?:\s*(?:steps?|ticks?))?")
_DURATION_RE = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<u>ms|s|m|h|d)")
_SECONDS_PER: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_GRAMMAR = 'a step count (500, "500 steps") or a duration ("30s", "10m", "2h", "1d")'


@dataclass(frozen=True, slots=True)
class Span:
    """A length of time, in steps (ticks) or in seconds."""

    amount: float
    unit: Unit

    @property
    def steps(self) -> bool:
        """True when the span counts steps rather than seconds."""
        return self.unit == "steps"

    def scaled(self, factor: float, cap: Span | None) -> Span:
        """This span times `factor`, no longer than `cap` (used by back-off)."""
        amount = self.amount * factor
        if cap is not None and amount > cap.amount:
            amount = cap.amount
        if self.steps:
            amount = float(math.ceil(amount))
        return Span(amount, self.unit)

    def describe(self) -> str:
        """Human text: ``100 steps``, ``1 step``, ``10m``, ``30s``."""
        if self.steps:
            count = int(self.amount)
            return f"{count} step" if count == 1 else f"{count} steps"
        seconds = self.amount
        for suffix, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
            if seconds >= size and (seconds / size).is_integer():
                return f"{int(seconds / size)}{suffix}"
        return f"{seconds:g}s"

    def to_json(self) -> str | int:
        """The form a policy file would use for this span."""
        return int(self.amount) if self.steps else self.describe()


def parse_span(value: Any) -> Span:
    """Parse a span from policy YAML; raise a pydantic error naming the grammar."""
    if isinstance(value, Span):
        return value
    if isinstance(value, bool) or value is None:
        raise PydanticCustomError("span", f"expected {_GRAMMAR}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise PydanticCustomError("span", f"a span cannot be negative, got {value}")
        return _bounded(Span(float(value), "steps"))
    if isinstance(value, str) and len(value) <= 40:
        text = value.strip()
        match = _STEPS_RE.fullmatch(text)
        if match:
            return _bounded(Span(float(int(match["n"])), "steps"))
        match = _DURATION_RE.fullmatch(text)
        if match:
            return _bounded(Span(float(match["n"]) * _SECONDS_PER[match["u"]], "seconds"))
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise PydanticCustomError("span", f"expected {_GRAMMAR}, got {shown}")


MAX_SPAN = 1e9  # steps, or seconds (about 31 years)


def _bounded(span: Span) -> Span:
    if span.amount > MAX_SPAN:
        unit = "steps" if span.steps else "seconds"
        raise PydanticCustomError("span", f"a span is at most {MAX_SPAN:.0f} {unit}")
    return span
