"""Rule predicates: the compiled form of a rule's `when:` clause.

A `when` is one mapping or a list of mappings; every key of every mapping
must hold (AND). `anomaly` lists kinds (any of them), `severity` is a
minimum, `ranks` and `source` list allowed values, and the numeric fields
(`value`, `threshold`, `ratio` = value / threshold, `step`) take a
comparison string such as ``"> 1e5"``. Comparisons are parsed into an
operator and a number; nothing is evaluated.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticCustomError

from remedy.policies._events import AnomalyEvent
from remedy.policies._vocab import severity_rank

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}
_CMP_RE = re.compile(
    r"\s*(>=|<=|==|!=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf)\s*"
)
COMPARABLE_FIELDS = ("value", "threshold", "ratio", "step")


@dataclass(frozen=True, slots=True)
class Comparison:
    """`field OP number`, e.g. value > 1e5."""

    op: str
    number: float

    def holds(self, x: float | None) -> bool:
        """Whether `x OP number`; a missing value never matches."""
        return x is not None and _OPS[self.op](x, self.number)

    def describe(self) -> str:
        """The policy-file form: ``> 100000``."""
        return f"{self.op} {self.number:g}"


def parse_comparison(value: Any) -> Comparison:
    """Parse ``"> 1e5"``; raise a pydantic error that shows the grammar."""
    if isinstance(value, str):
        match = _CMP_RE.fullmatch(value)
        if match:
            return Comparison(match[1], float(match[2]))
    raise PydanticCustomError(
        "comparison",
        f'expected a comparison such as "> 1e5" (operators: {" ".join(_OPS)}), got {value!r}',
    )


@dataclass(frozen=True, slots=True)
class Matcher:
    """Everything a rule requires of one event, beyond its kind.

    `kinds` is used by the engine's index (events only reach rules that name
    their kind); `__call__` checks the rest. `trivial` is true when nothing
    is left to check, which lets the engine skip the call.
    """

    kinds: frozenset[str] | None = None
    min_severity: int = 0
    ranks: frozenset[int] | None = None
    sources: frozenset[str] | None = None
    comparisons: tuple[tuple[str, Comparison], ...] = ()

    @property
    def trivial(self) -> bool:
        """True when any event of a listed kind matches."""
        return (
            self.min_severity == 0
            and self.ranks is None
            and self.sources is None
            and not self.comparisons
        )

    def __call__(self, event: AnomalyEvent) -> bool:
        if self.kinds is not None and event.kind not in self.kinds:
            return False
        if self.min_severity and severity_rank(event.severity) < self.min_severity:
            return False
        if self.ranks is not None and event.rank not in self.ranks:
            return False
        if self.sources is not None and event.source not in self.sources:
            return False
        return all(cmp.holds(_field(event, name)) for name, cmp in self.comparisons)

    def covers(self, other: Matcher) -> bool:
        """True when every event `other` matches is also matched by this one (for lints)."""
        if self.kinds is not None and (other.kinds is None or not other.kinds <= self.kinds):
            return False
        if self.min_severity > other.min_severity:
            return False
        if self.ranks is not None and (other.ranks is None or not other.ranks <= self.ranks):
            return False
        if self.sources is not None and (
            other.sources is None or not other.sources <= self.sources
        ):
            return False
        return set(self.comparisons) <= set(other.comparisons)


def _field(event: AnomalyEvent, name: str) -> float | None:
    if name == "value":
        return event.value
    if name == "threshold":
        return event.threshold
    if name == "step":
        return float(event.step)
    if event.value is None or not event.threshold:
        return None
    ratio = event.value / event.threshold
    return None if math.isnan(ratio) else ratio


def combine(parts: list[Matcher]) -> Matcher:
    """AND several matchers (the list form of `when`) into one."""
    kinds: frozenset[str] | None = None
    ranks: frozenset[int] | None = None
    sources: frozenset[str] | None = None
    severity = 0
    comparisons: list[tuple[str, Comparison]] = []
    for part in parts:
        if part.kinds is not None:
            kinds = part.kinds if kinds is None else kinds & part.kinds
        if part.ranks is not None:
            ranks = part.ranks if ranks is None else ranks & part.ranks
        if part.sources is not None:
            sources = part.sources if sources is None else sources & part.sources
        severity = max(severity, part.min_severity)
        comparisons.extend(c for c in part.comparisons if c not in comparisons)
    return Matcher(kinds, severity, ranks, sources, tuple(comparisons))
