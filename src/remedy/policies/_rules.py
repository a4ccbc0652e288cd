"""The compiled, immutable form of a policy: `Policy`, `Rule`, `Step`.

These are what the engine runs. They hold no pydantic objects: parameters
are frozen mappings of JSON values (lists become tuples), and `thaw` gives
a decision its own plain, mutable copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from remedy.policies._diagnostics import Diagnostic
from remedy.policies._notify import NotifySink
from remedy.policies._predicates import Matcher
from remedy.policies._spans import Span
from remedy.policies._vocab import DISRUPTIVE_ACTIONS


class FrozenMap(Mapping[str, Any]):
    """A read-only mapping that pickles (policies travel to Ray actors)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items(), key=lambda kv: kv[0])))

    def __reduce__(self) -> tuple[type[FrozenMap], tuple[dict[str, Any]]]:
        return (type(self), (self._data,))


def freeze(value: Any) -> Any:
    """A read-only copy of a JSON value (mappings become `FrozenMap`s, lists tuples)."""
    if isinstance(value, Mapping):
        return FrozenMap({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A plain, mutable copy of a frozen JSON value."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class Escalation:
    """Where to go next: `next` (rest of the chain), `abort`, `notify`, or another rule."""

    kind: Literal["next", "abort", "notify", "rule"]
    rule: str | None = None

    def describe(self) -> str:
        """Human text: ``abort`` or ``rule 'nan-abort'``."""
        return f"rule {self.rule!r}" if self.kind == "rule" else self.kind

    def to_json(self) -> str | dict[str, str]:
        """The policy-file form."""
        return {"rule": self.rule or ""} if self.kind == "rule" else self.kind


@dataclass(frozen=True, slots=True)
class Step:
    """One action of a rule's chain, its filled-in parameters, and what to do if it fails."""

    action: str
    params: Mapping[str, Any]
    on_failure: Escalation | None = None

    @property
    def disruptive(self) -> bool:
        """True for actions that interrupt every rank (at most one in flight)."""
        return self.action in DISRUPTIVE_ACTIONS


@dataclass(frozen=True, slots=True)
class Backoff:
    """Cooldown growth: base × factor^(n-1) after the n-th consecutive firing, up to `max`."""

    factor: float
    initial: Span | None = None
    max: Span | None = None
    reset_after: Span | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    """One compiled rule. `line` is where it starts in the policy file."""

    name: str
    matcher: Matcher
    steps: tuple[Step, ...]
    description: str | None = None
    count: int = 1
    within: Span | None = None
    persist: int = 1
    group_by: tuple[str, ...] = ("kind", "step")
    cooldown: Span | None = None
    max_fires: int | None = None
    fires_within: Span | None = None
    on_exhausted: Escalation = Escalation("abort")
    backoff: Backoff | None = None
    cont: bool = False
    line: int = 0
    escalation_only: bool = False

    @property
    def disruptive(self) -> bool:
        """True when any step of the chain is disruptive."""
        return any(step.disruptive for step in self.steps)

    @property
    def base_cooldown(self) -> Span | None:
        """The cooldown back-off grows from: `cooldown`, else `backoff.initial`."""
        if self.cooldown is not None:
            return self.cooldown
        return self.backoff.initial if self.backoff is not None else None


@dataclass(frozen=True, slots=True)
class Inhibit:
    """`anomalies` fire nothing while `while_action` is in flight and `warmup_steps` after."""

    while_action: str
    anomalies: frozenset[str]
    warmup_steps: int = 0


@dataclass(frozen=True)
class Policy:
    """A validated, immutable policy: ordered rules plus policy-level settings.

    `warnings` holds the semantic lint findings (`check_policy` reports them;
    loading does not fail on them).
    """

    name: str
    rules: tuple[Rule, ...]
    source_file: str = "<string>"
    dry_run: bool = False
    inhibit: tuple[Inhibit, ...] = ()
    description: str | None = None
    version: int = 1
    warnings: tuple[Diagnostic, ...] = ()
    # Where `notify` decisions are delivered (the policy's `notify:` list).
    notify: tuple[NotifySink, ...] = ()
    _by_name: Mapping[str, Rule] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", FrozenMap({r.name: r for r in self.rules}))

    def rule(self, name: str) -> Rule | None:
        """The rule called `name`, or None."""
        return self._by_name.get(name)

    def uses(self, action: str) -> bool:
        """Whether a rule of this policy can take `action`."""
        return any(step.action == action for rule in self.rules for step in rule.steps)

    @property
    def rule_names(self) -> tuple[str, ...]:
        """Rule names in file order."""
        return tuple(r.name for r in self.rules)
