"""The mutable state of one rule: its counting window, streak, firings and cooldown.

Kept apart from the immutable `Rule` so a policy reload can keep the state
of rules that survive it. The counters are kept per *state key* (see
`state_fields`): one set per rule, or one per kind with `group_by: [kind]`.
All step arithmetic uses ticks (executed steps), which keep growing across
rollbacks; durations use event timestamps. A moment that lies further in
the future than a whole span (an event with an absurd tick or timestamp)
does not hold a window or cooldown open: spans stay as long as they say.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any

from remedy.policies._events import AnomalyEvent
from remedy.policies._rules import Rule
from remedy.policies._spans import Span

GroupKey = Any
StateKey = tuple[Any, ...]
_RECENT_GROUPS = 256
MAX_STATE_KEYS = 4096  # per rule; the least recently seen key is forgotten beyond this


def _elapsed(span: Span, tick: int, ts: float, then: tuple[int, float]) -> float:
    """Steps (or seconds) from `then` to now; +inf when `then` is more than a span ahead."""
    gone = tick - then[0] if span.steps else ts - then[1]
    return math.inf if gone < -span.amount else gone


def _within(span: Span, tick: int, ts: float, then: tuple[int, float]) -> bool:
    """Whether a moment `then` is inside a window of `span` ending now."""
    gone = _elapsed(span, tick, ts, then)
    return gone < span.amount if span.steps else gone <= span.amount


class KeyState:
    """The rate-limit counters of one rule for one state key (see module docstring)."""

    def __init__(self, rule: Rule) -> None:
        self.hits: deque[tuple[int, float]] = deque(maxlen=rule.count)
        self.streak_start: int | None = None
        self.last_true: int | None = None
        self.fires: deque[tuple[int, float]] = deque(maxlen=rule.max_fires)
        self.last_fire: tuple[int, float, int] | None = None  # tick, ts, step
        self.fire_count = 0
        self.consecutive = 0
        self.cooldown: Span | None = rule.cooldown
        self.marker: str | None = None
        self.escalated: str | None = None

    def adapt(self, rule: Rule) -> None:
        """Keep the counters across a reload, resized for the rule's new limits."""
        self.hits = deque(self.hits, maxlen=rule.count)
        self.fires = deque(self.fires, maxlen=rule.max_fires)
        if self.consecutive == 0 or rule.backoff is None:
            self.cooldown = rule.cooldown

    def observe(self, rule: Rule, tick: int, ts: float) -> bool:
        """Count one occurrence; True when the rule's count and persist conditions hold."""
        met = True
        if rule.count > 1 and rule.within is not None:
            self.hits.append((tick, ts))
            met = len(self.hits) == rule.count and _within(rule.within, tick, ts, self.hits[0])
        if rule.persist <= 1:
            return met
        if not met:
            return False
        # A gap breaks the streak; so does a tick far behind the last (an absurd one before).
        if (
            self.last_true is None
            or self.streak_start is None
            or not -rule.persist <= tick - self.last_true <= 1
        ):
            self.streak_start = tick
        self.last_true = tick
        return tick - self.streak_start + 1 >= rule.persist

    def cooldown_left(self, tick: int, ts: float) -> float:
        """Steps (or seconds) of cooldown left; 0 when the rule may fire."""
        if self.last_fire is None or self.cooldown is None:
            return 0.0
        span = self.cooldown
        gone = _elapsed(span, tick, ts, self.last_fire[:2])
        # Never longer than the cooldown itself (a late event from a lagging rank).
        return min(span.amount, max(0.0, span.amount - gone))

    def exhausted(self, rule: Rule, tick: int, ts: float) -> bool:
        """True when the rule has fired `max_fires` times within `fires_within`."""
        if rule.max_fires is None:
            return False
        if rule.fires_within is not None:
            while self.fires and not _within(rule.fires_within, tick, ts, self.fires[0]):
                self.fires.popleft()
        return len(self.fires) >= rule.max_fires

    def exhaustion_period(self) -> str:
        """Names the current exhaustion: it ends when the oldest firing leaves the window."""
        return f"x{self.fires[0][0]}" if self.fires else "x"

    def record_fire(self, rule: Rule, tick: int, ts: float, step: int) -> int:
        """Note a firing (window, back-off, cooldown); return its number within the window."""
        backoff = rule.backoff
        if (
            backoff is not None
            and self.last_fire is not None
            and backoff.reset_after is not None
            and not _within(backoff.reset_after, tick, ts, self.last_fire[:2])
        ):
            # A healthy period since the last firing: start the back-off over.
            self.consecutive = 0
        self.consecutive += 1
        base = rule.base_cooldown
        if backoff is not None and base is not None:
            self.cooldown = base.scaled(backoff.factor ** (self.consecutive - 1), backoff.max)
        else:
            self.cooldown = rule.cooldown
        self.fires.append((tick, ts))
        self.last_fire = (tick, ts, step)
        self.fire_count += 1
        self.hits.clear()
        self.streak_start = self.last_true = None
        self.marker = None
        return len(self.fires)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for `Engine.state_dict`."""
        return {
            "hits": [list(h) for h in self.hits],
            "streak_start": self.streak_start,
            "last_true": self.last_true,
            "fires": [list(f) for f in self.fires],
            "last_fire": list(self.last_fire) if self.last_fire is not None else None,
            "fire_count": self.fire_count,
            "consecutive": self.consecutive,
            "cooldown": [self.cooldown.amount, self.cooldown.unit] if self.cooldown else None,
            "marker": self.marker,
            "escalated": self.escalated,
        }

    @classmethod
    def from_dict(cls, rule: Rule, data: dict[str, Any]) -> KeyState:
        """Rebuild from `to_dict` output (raises KeyError/TypeError/ValueError if malformed)."""
        state = cls(rule)
        state.hits.extend((_tick(t), float(s)) for t, s in data["hits"])
        state.streak_start = _opt_int(data["streak_start"])
        state.last_true = _opt_int(data["last_true"])
        state.fires.extend((_tick(t), float(s)) for t, s in data["fires"])
        lf = data["last_fire"]
        state.last_fire = (_tick(lf[0]), float(lf[1]), _tick(lf[2])) if lf is not None else None
        state.fire_count = _tick(data["fire_count"])
        state.consecutive = _tick(data["consecutive"])
        cd = data["cooldown"]
        state.cooldown = None
        if cd is not None:
            state.cooldown = Span(float(cd[0]), "steps" if cd[1] == "steps" else "seconds")
        state.marker = _opt_str(data["marker"])
        state.escalated = _opt_str(data["escalated"])
        return state


class RuleState:
    """Everything one rule remembers: its recent groups, and counters per state key."""

    def __init__(self, rule: Rule) -> None:
        self.fields = state_fields(rule)
        self.keys: OrderedDict[StateKey, KeyState] = OrderedDict()
        self.recent: OrderedDict[GroupKey, tuple[set[int], bool]] = OrderedDict()
        self._rule = rule

    def adapt(self, rule: Rule) -> None:
        """Keep the counters across a reload; start over if the state key's fields changed."""
        self._rule = rule
        fields = state_fields(rule)
        if fields != self.fields:
            self.fields = fields
            self.keys.clear()
            return
        for state in self.keys.values():
            state.adapt(rule)

    def for_event(self, event: AnomalyEvent) -> KeyState:
        """The counters for `event`'s state key, created (and the oldest forgotten) as needed."""
        key = tuple(getattr(event, f) for f in self.fields)
        state = self.keys.get(key)
        if state is None:
            state = self.keys[key] = KeyState(self._rule)
            if len(self.keys) > MAX_STATE_KEYS:
                self.keys.popitem(last=False)
        elif len(self.keys) > 1:
            self.keys.move_to_end(key)
        return state

    def describe_key(self, event: AnomalyEvent) -> str:
        """`` for kind data_stall`` when the state is per key; empty when per rule."""
        if not self.fields:
            return ""
        return " for " + ", ".join(f"{f} {getattr(event, f)}" for f in self.fields)

    def seen_group(self, key: GroupKey, ranks: set[int]) -> bool | None:
        """For late events of a group already seen (other ranks, same key): its claim; else None."""
        prior = self.recent.get(key)
        if prior is None or not prior[0].isdisjoint(ranks):
            return None
        prior[0].update(ranks)
        return prior[1]

    def remember(self, key: GroupKey, ranks: set[int], claimed: bool) -> None:
        """Remember a group so late arrivals from other ranks are not counted again."""
        self.recent[key] = (set(ranks), claimed)
        self.recent.move_to_end(key)
        if len(self.recent) > _RECENT_GROUPS:
            self.recent.popitem(last=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form for `Engine.state_dict`."""
        return {
            "fields": list(self.fields),
            "keys": [[list(k), s.to_dict()] for k, s in self.keys.items()],
            "recent": [[_jsonable(k), sorted(r), c] for k, (r, c) in self.recent.items()],
        }

    @classmethod
    def from_dict(cls, rule: Rule, data: dict[str, Any]) -> RuleState:
        """Rebuild from `to_dict` output (raises KeyError/TypeError/ValueError if malformed).

        A state saved before counters were kept per key (no ``keys``) restores as the
        counters of a rule whose state is per rule; for a per-key rule it starts fresh.
        """
        state = cls(rule)
        if "keys" not in data:
            if not state.fields:
                state.keys[()] = KeyState.from_dict(rule, data)
        elif tuple(data["fields"]) == state.fields:
            for key, raw in data["keys"][-MAX_STATE_KEYS:]:
                state.keys[tuple(key)] = KeyState.from_dict(rule, raw)
        for key, ranks, claimed in data["recent"]:
            state.recent[_hashable(key)] = (set(ranks), bool(claimed))
        return state


def state_fields(rule: Rule) -> tuple[str, ...]:
    """The group_by fields a rule's counters are kept per.

    A rule's cooldown, back-off, `count`/`within` window, `persist` streak and
    `max_fires` are kept per value of its `group_by` fields, when `group_by`
    leaves out `step`: with `group_by: [kind]` each kind has its own cooldown.
    A key holding the step changes every step, so a rule grouping by step (the
    default `[kind, step]`, or `[kind, step, rank]`) keeps one set of counters.
    """
    return () if "step" in rule.group_by else rule.group_by


# Ticks, steps and counts of a saved state are exact in a float (they meet seconds and
# float spans in the cooldown arithmetic); a larger one is corruption.
MAX_TICK = 2**53


def _tick(value: Any) -> int:
    """A saved tick, step or count: an integer (an integral float is taken) within MAX_TICK."""
    if isinstance(value, bool):
        raise TypeError("expected an integer, got bool")
    out = int(value)
    if not -MAX_TICK <= out <= MAX_TICK:
        raise ValueError(f"a tick of {len(str(abs(out)))} digits is out of range")
    return out


def _opt_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer or null, got {type(value).__name__}")
    return _tick(value)


def _opt_str(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"expected a string or null, got {type(value).__name__}")
    return value


def _jsonable(key: GroupKey) -> Any:
    return list(key) if isinstance(key, tuple) else key


def _hashable(key: Any) -> GroupKey:
    return tuple(key) if isinstance(key, list) else key
