"""Report batches are untrusted input: validate each item on its own.

A rank's report batch is a mapping `{rank, step, tick, ts, events, metrics,
outcomes}`. `validate_batch` turns one into a `Report` holding only the items
that passed, plus a count of rejections by reason; nothing here raises on
bad input, and a bad item never takes good ones with it.

Checks, beyond each item's own shape:
- the batch's rank is inside the world, and each item is about that rank;
- steps and ticks are integers no further ahead of the rank's last report
  than it could have run since (`Limits.max_ahead` plus
  `Limits.ahead_per_s` per second elapsed): a phantom report with
  `tick = 10**12` would otherwise postpone every command to that tick, and
  an event at step `10**30` would put its rule in a cooldown that never ends;
- an event's or a metrics record's tick is not after the batch's (ticks
  count executed steps, and events describe steps already run);
- sizes are bounded: events per batch and per rank per tick, metrics and
  outcomes per batch, and the size of each record's free-form parts, so a
  flood cannot block the supervisor or fill the run directory.

Going back is always allowed: steps go back after a rollback, and a
restarted rank's ticks start again from 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from remedy.policies import AnomalyEvent, EventError
from remedy.protocol.commands import Outcome

# Integers that survive a JSON round trip as integers.
MAX_INT = 2**53

# Top-level keys a batch may have; others are counted and ignored.
BATCH_FIELDS = frozenset(
    {
        *("rank", "step", "tick", "ts", "events", "metrics", "outcomes"),
        # Read by the supervisor beside the Controller: the rank slot's incarnation and the
        # batch's sequence number (stale reports), and the step total and batch size (displays);
        # the run's token, which the supervisor checks before anything else.
        *("incarnation", "seq", "max_steps", "batch_size", "token"),
        # The rank's loop ended (its last report: the hang watch stops expecting steps), and
        # its notes of a supervisor that did not answer for a while (supervisor.liveness).
        *("ending", "outages"),
        # The tick of a flagged step the rank holds for (workers.flag_hold): the reply
        # then says whether every decision on it is taken.
        "holding",
        # Holding at its last step (rank.link.end_hold): settled once nothing is owed to it.
        "final",
        # The first report of a new generation of the group (a restart waits on it): a node
        # agent sends its digest at once (`AgentCore.take`'s `Taken.hurry`).
        "regrouped",
        # The lowest batch number the rank still awaits an answer to (`supervisor.reporter`):
        # read by the supervisor's rank slots and a node agent's.
        "unanswered_from",
        # The rank's collective has just failed (`workers.membership`): the supervisor pings
        # every rank at once (`Recovery.alarm`).
        "collective_failed",
    }
)

_OUTCOME_FIELDS = frozenset(
    {"decision_id", "rank", "outcome", "step", "tick", "detail", "result", "attempts"}
)


@dataclass(frozen=True, slots=True)
class Limits:
    """How much one batch may carry and how far ahead of its rank it may run."""

    max_events_per_batch: int = 1024
    max_events_per_tick: int = 32  # one rank, one executed step
    max_metrics_per_batch: int = 10_000
    max_outcomes_per_batch: int = 256
    max_ahead: int = 10_000  # steps or ticks past the rank's last report, at once
    ahead_per_s: int = 10_000  # and per second since it, for a rank that really is fast
    max_nodes: int = 256  # values in one record's free-form parts (details, result)
    max_text: int = 4096  # characters in one string


@dataclass(frozen=True, slots=True)
class RankMark:
    """The last accepted report of a rank: where the next one is measured from."""

    step: int
    tick: int
    at: float


@dataclass
class Report:
    """The valid parts of one batch."""

    rank: int
    step: int
    tick: int
    events: list[AnomalyEvent] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    tick_counts: dict[int, int] = field(default_factory=dict)  # events accepted per tick
    # For displays: the step total and batch size, when the batch gave valid ones.
    max_steps: int | None = None
    batch_size: int | None = None

    def as_batch(self) -> dict[str, Any]:
        """The valid parts in the shape of a batch, for what watches a run (feed, metrics)."""
        out: dict[str, Any] = {
            "rank": self.rank,
            "step": self.step,
            "tick": self.tick,
            "events": [ev.to_dict() for ev in self.events],
            "metrics": self.metrics,
        }
        if self.max_steps is not None:
            out["max_steps"] = self.max_steps
        if self.batch_size is not None:
            out["batch_size"] = self.batch_size
        return out


@dataclass
class _Context:
    rank: int
    step: int
    tick: int
    step_ceiling: int  # the largest step an item may name
    tick_floor: int  # the smallest tick an item may name


def validate_batch(
    batch: Any,
    *,
    world_size: int,
    last: RankMark | None,
    origin: RankMark | None,
    now: float,
    limits: Limits,
    rejected: Counter[str],
    tick_counts: dict[int, int] | None = None,
) -> Report | None:
    """The valid items of `batch`, or None if its header is invalid; count every rejection.

    `last` is the rank's last accepted report (None for its first); `origin`
    is where a first report is measured from (the start of the run, the
    furthest step any rank reached; may be None when `last` is given). `tick_counts` (tick -> events accepted,
    from the rank's previous `Report`) carries the per-tick event cap across
    its batches.
    """
    if not isinstance(batch, Mapping):
        rejected["batch_not_mapping"] += 1
        return None
    rank = _int(batch.get("rank"))
    step = _int(batch.get("step"))
    tick = _int(batch.get("tick", batch.get("step")))
    if rank is None:
        rejected["batch_bad_rank"] += 1
        return None
    if rank >= world_size:
        rejected["batch_rank_outside_world"] += 1
        return None
    if step is None:
        rejected["batch_bad_step"] += 1
        return None
    if tick is None:
        rejected["batch_bad_tick"] += 1
        return None
    if last is not None:
        ref = last
    elif origin is not None:
        ref = RankMark(origin.step, 0, origin.at)
    else:
        raise ValueError("validate_batch needs `origin` for a rank's first report")
    slack = limits.max_ahead + int(max(now - ref.at, 0.0) * limits.ahead_per_s)
    if step > ref.step + slack:
        rejected["batch_step_too_far_ahead"] += 1
        return None
    if tick > ref.tick + slack:
        rejected["batch_tick_too_far_ahead"] += 1
        return None
    unknown = sum(1 for key in batch if key not in BATCH_FIELDS)
    if unknown:
        rejected["batch_unknown_field"] += unknown
    # An item may name a step a little past the batch's: a rank that rolled
    # back after detecting an anomaly reports both in one batch.
    ctx = _Context(
        rank,
        step,
        tick,
        step_ceiling=max(step, last.step if last else 0) + slack,
        tick_floor=max(tick - slack, 0),
    )
    counts = _tick_counts(tick_counts, last, tick, ctx.tick_floor)
    report = Report(
        rank,
        step,
        tick,
        tick_counts=counts,
        max_steps=_int(batch.get("max_steps")),
        batch_size=_int(batch.get("batch_size")),
    )
    for raw in _items(batch, "events", limits.max_events_per_batch, rejected):
        ev = _event(raw, ctx, limits, rejected)
        if ev is None:
            continue
        if counts.get(ev.tick, 0) >= limits.max_events_per_tick:
            rejected["events_over_tick_cap"] += 1
            continue
        counts[ev.tick] = counts.get(ev.tick, 0) + 1
        report.events.append(ev)
    for raw in _items(batch, "metrics", limits.max_metrics_per_batch, rejected):
        record = _metrics(raw, ctx, limits)
        if record is None:
            rejected["metrics_invalid"] += 1
        else:
            report.metrics.append(record)
    for raw in _items(batch, "outcomes", limits.max_outcomes_per_batch, rejected):
        outcome = _outcome(raw, ctx, limits)
        if outcome is None:
            rejected["outcome_invalid"] += 1
        else:
            report.outcomes.append(outcome)
    return report


def _tick_counts(
    counts: dict[int, int] | None, last: RankMark | None, tick: int, floor: int
) -> dict[int, int]:
    """The rank's per-tick event counts, forgetting ticks no item can name any more."""
    if counts is None:
        return {}
    if last is not None and tick < last.tick:
        counts.clear()  # a restarted rank counts its ticks from 0 again
    elif len(counts) > 64:
        for old in [t for t in counts if t < floor]:
            del counts[old]
    return counts


def _items(batch: Mapping[str, Any], key: str, cap: int, rejected: Counter[str]) -> list[Any]:
    """The list under `key`, at most `cap` long; a non-list and the excess are counted."""
    value = batch.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        rejected[f"{key}_not_list"] += 1
        return []
    if len(value) > cap:
        rejected[f"{key}_over_batch_cap"] += len(value) - cap
        return value[:cap]
    return value


def _event_reason(raw: Any, exc: EventError) -> str:
    """The rejection count an event refused by `AnomalyEvent.from_dict` goes to."""
    if exc.reason == "bad_details":
        return "event_too_large"  # oversized, too deep or not plain data
    field = {"bad_step": "step", "bad_tick": "tick"}.get(exc.reason)
    if field is not None and isinstance(raw, dict) and type(raw.get(field)) is int:
        return f"event_{field}_out_of_range"  # a whole number, but negative or absurdly far
    return "event_invalid"


def _event(raw: Any, ctx: _Context, limits: Limits, rejected: Counter[str]) -> AnomalyEvent | None:
    try:
        ev = AnomalyEvent.from_dict(raw)
    except EventError as exc:
        rejected[_event_reason(raw, exc)] += 1
        return None
    if ev.rank != ctx.rank:
        rejected["event_rank_mismatch"] += 1
        return None
    if ev.step > ctx.step_ceiling:
        rejected["event_step_out_of_range"] += 1
        return None
    if not ctx.tick_floor <= ev.tick <= ctx.tick:
        rejected["event_tick_out_of_range"] += 1
        return None
    if ev.details and not _bounded(ev.details, limits):
        rejected["event_too_large"] += 1
        return None
    return ev


def _metrics(raw: Any, ctx: _Context, limits: Limits) -> dict[str, Any] | None:
    """A metrics record that is plain bounded data about this rank's steps, else None."""
    if not isinstance(raw, dict) or not _bounded(raw, limits):
        return None
    step = _int(raw.get("step"))
    tick = _int(raw.get("tick", raw.get("step")))
    if step is None or tick is None or step > ctx.step_ceiling:
        return None
    if not ctx.tick_floor <= tick <= ctx.tick:
        return None
    if "rank" in raw and raw["rank"] != ctx.rank:
        return None
    return raw


def _outcome(raw: Any, ctx: _Context, limits: Limits) -> Outcome | None:
    if not isinstance(raw, dict) or not set(raw) <= _OUTCOME_FIELDS:
        return None
    decision_id, detail, result = raw.get("decision_id"), raw.get("detail", ""), raw.get("result")
    step, tick, attempts = (
        _int(raw.get("step")),
        _int(raw.get("tick")),
        _int(raw.get("attempts", 1)),
    )
    if (
        not isinstance(decision_id, str)
        or not 0 < len(decision_id) <= limits.max_text
        or raw.get("rank") != ctx.rank
        or type(raw.get("rank")) is not int
        or raw.get("outcome") not in ("applied", "failed")
        or step is None
        or tick is None
        or tick > ctx.tick
        or attempts is None
        or not isinstance(detail, str)
        or not (result is None or (isinstance(result, dict) and _bounded(result, limits)))
    ):
        return None
    return Outcome(
        decision_id,
        ctx.rank,
        str(raw["outcome"]),
        step,
        tick,
        detail[: limits.max_text],
        dict(result or {}),
        attempts,
    )


def _int(value: Any) -> int | None:
    """A step-like integer (not a bool, 0 <= value < 2**53), else None."""
    if type(value) is not int or not 0 <= value < MAX_INT:
        return None
    return value


def _bounded(value: Any, limits: Limits) -> bool:
    """True if `value` is plain JSON-like data (string keys, numbers a float can hold) of bounded size.

    Every value counts against `limits.max_nodes`, containers included. A
    metrics record (a flat mapping of numbers) is checked on every batch of
    every rank, so a mapping's scalar values of exact built-in types are
    checked in place; anything else goes through the general path.
    """
    budget = limits.max_nodes
    max_text = limits.max_text
    stack = [value]
    while stack:
        budget -= 1
        if budget < 0:
            return False
        item = stack.pop()
        if type(item) is dict:
            for key, v in item.items():
                if not isinstance(key, str) or len(key) > max_text:
                    return False
                t = type(v)
                if t is float or t is bool or v is None:
                    budget -= 1
                elif t is int:
                    if abs(v) >= MAX_INT:
                        return False
                    budget -= 1
                elif t is str:
                    if len(v) > max_text:
                        return False
                    budget -= 1
                else:
                    stack.append(v)  # counted when taken
            if budget < 0:
                return False
        elif not _node_ok(item, stack, max_text):
            return False
    return True


def _node_ok(item: Any, stack: list[Any], max_text: int) -> bool:
    """Check one value of any type; a container's items go onto `stack`."""
    if item is None or isinstance(item, bool):
        return True
    if isinstance(item, int):
        return abs(item) < MAX_INT
    if isinstance(item, float):
        return True  # NaN and infinities are honest values of a diverged step
    if isinstance(item, str):
        return len(item) <= max_text
    if isinstance(item, list):
        stack.extend(item)
        return True
    if isinstance(item, dict):
        if not all(isinstance(k, str) and len(k) <= max_text for k in item):
            return False
        stack.extend(item.values())
        return True
    return False
