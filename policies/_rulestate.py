"""The mutable state of one rule: its counting window, streak, firings and cooldown.

Kept apart from the immutable `Rule` so a policy reload can keep the state
of rules that survive it. All step arithmetic uses ticks (executed steps),
which keep growing across rollbacks; durations use event timestamps.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

from remedy.policies._rules import Rule
from remedy.policies._spans import Span

GroupKey = Any
_RECENT_GROUPS = 256


def _within(span: Span, tick: int, ts: float, then: tuple[int, float]) -> bool:
    """Whether a moment `then` is inside a window of `span` ending now."""
    if span.steps:
        return tick - then[0] < span.amount
    return ts - then[1] <= span.amount


class RuleState:
    """Counters of one rule (see module docstring)."""

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
        self.recent: OrderedDict[GroupKey, tuple[set[int], bool]] = OrderedDict()

    def adapt(self, rule: Rule) -> None:
        """Keep the counters across a reload, resized for the rule's new limits."""
        self.hits = deque(self.hits, maxlen=rule.count)
        self.fires = deque(self.fires, maxlen=rule.max_fires)
        if self.consecutive == 0 or rule.backoff is None:
            self.cooldown = rule.cooldown

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
        if self.last_true is None or tick - self.last_true > 1 or self.streak_start is None:
            self.streak_start = tick
        self.last_true = tick
        return tick - self.streak_start + 1 >= rule.persist

    def cooldown_left(self, tick: int, ts: float) -> float:
        """Steps (or seconds) of cooldown left; 0 when the rule may fire."""
        if self.last_fire is None or self.cooldown is None:
            return 0.0
        if self.cooldown.steps:
            return max(0.0, self.last_fire[0] + self.cooldown.amount - tick)
        return max(0.0, self.last_fire[1] + self.cooldown.amount - ts)

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
            "recent": [[_jsonable(k), sorted(r), c] for k, (r, c) in self.recent.items()],
        }

    @classmethod
    def from_dict(cls, rule: Rule, data: dict[str, Any]) -> RuleState:
        """Rebuild from `to_dict` output (raises KeyError/TypeError/ValueError if malformed)."""
        state = cls(rule)
        state.hits.extend((int(t), float(s)) for t, s in data["hits"])
        state.streak_start = data["streak_start"]
        state.last_true = data["last_true"]
        state.fires.extend((int(t), float(s)) for t, s in data["fires"])
        lf = data["last_fire"]
        state.last_fire = (int(lf[0]), float(lf[1]), int(lf[2])) if lf is not None else None
        state.fire_count = int(data["fire_count"])
        state.consecutive = int(data["consecutive"])
        cd = data["cooldown"]
        state.cooldown = None
        if cd is not None:
            state.cooldown = Span(float(cd[0]), "steps" if cd[1] == "steps" else "seconds")
        state.marker = data["marker"]
        state.escalated = data["escalated"]
        for key, ranks, claimed in data["recent"]:
            state.recent[_hashable(key)] = (set(ranks), bool(claimed))
        return state


def _jsonable(key: GroupKey) -> Any:
    return list(key) if isinstance(key, tuple) else key


def _hashable(key: Any) -> GroupKey:
    return tuple(key) if isinstance(key, list) else key
