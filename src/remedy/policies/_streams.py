"""The compact per-step notation for synthetic anomaly streams.

A pattern is a space-separated list of tokens, one step each: ``_`` means
no event at that step, a number (``1``, ``5.0e4``, ``nan``, ``inf``) means
an event whose `value` is that number. ``xN`` repeats a token N times:
``"_x100 1x3 _x50"`` is nothing for 100 steps, the anomaly for 3 steps, then
nothing for 50. Steps count from `start_step` (1 by default), and tick
equals step: synthetic streams do not rewind.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from remedy.policies._events import MAX_STEP, AnomalyEvent
from remedy.policies._vocab import ANOMALY_KINDS
from remedy.policies.exceptions import PolicyTestError

MAX_STREAM_RANKS = 4096  # ranks one stream key may name
MAX_STREAM_STEPS = 1_000_000  # steps one pattern may span
MAX_TEST_EVENTS = 1_000_000  # events all the streams of one test may make
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|[-+]?inf"
_TOKEN = re.compile(rf"(?P<v>_|{_NUMBER})(?:x(?P<n>\d+))?")


def parse_pattern(pattern: str) -> list[float | None]:
    """One entry per step: the event value, or None for no event."""
    out: list[float | None] = []
    for token in pattern.split():
        match = _TOKEN.fullmatch(token)
        if match is None:
            raise PolicyTestError(
                f"bad token {_short(token)} in stream {_short(pattern)}: expected _ or a number, "
                'optionally followed by xN (e.g. "_x100 1x3 5.0e4")'
            )
        value = None if match["v"] == "_" else float(match["v"])
        repeat = int(match["n"]) if match["n"] and len(match["n"]) <= 9 else None
        if match["n"] and (repeat is None or len(out) + repeat > MAX_STREAM_STEPS):
            raise PolicyTestError(
                f"stream {_short(pattern)} is longer than {MAX_STREAM_STEPS} steps"
            )
        out.extend([value] * (repeat or 1))
        if len(out) > MAX_STREAM_STEPS:
            raise PolicyTestError(
                f"stream {_short(pattern)} is longer than {MAX_STREAM_STEPS} steps"
            )
    return out


def _short(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


def pattern_events(
    kind: str,
    pattern: str,
    ranks: Iterable[int],
    *,
    start_step: int = 1,
    severity: str = "warning",
    threshold: float | None = None,
    source: str = "detector",
    node: str | None = None,
    step_seconds: float = 1.0,
) -> list[AnomalyEvent]:
    """Events of one kind on some ranks following `pattern`, ordered by step then rank.

    `node`: the node the ranks ran on, as the supervisor stamps it (`details["node"]`).
    """
    if kind not in ANOMALY_KINDS:
        raise PolicyTestError(f"unknown anomaly kind {kind!r} (valid: {', '.join(ANOMALY_KINDS)})")
    ranks = sorted(set(ranks))
    values = parse_pattern(pattern)
    if start_step + len(values) > MAX_STEP:
        raise PolicyTestError(f"the stream goes past step {MAX_STEP}, the largest an event has")
    if sum(v is not None for v in values) * len(ranks) > MAX_TEST_EVENTS:
        raise PolicyTestError(f"the stream makes more than {MAX_TEST_EVENTS} events")
    events: list[AnomalyEvent] = []
    for offset, value in enumerate(values):
        if value is None:
            continue
        step = start_step + offset
        for rank in ranks:
            events.append(
                AnomalyEvent(
                    kind=kind,
                    rank=rank,
                    step=step,
                    value=value,
                    threshold=threshold,
                    severity=severity,
                    source=source,
                    ts=step * step_seconds,
                    tick=step,
                    details={"node": node} if node is not None else {},
                )
            )
    return events


_RANKS = re.compile(r"ranks?\s*(?P<a>\d+)(?:\s*-\s*(?P<b>\d+))?")


def parse_ranks(key: str) -> list[int]:
    """``rank0`` -> [0]; ``ranks0-3`` or ``rank 0-3`` -> [0, 1, 2, 3]."""
    match = _RANKS.fullmatch(key.strip())
    if match is None:
        raise PolicyTestError(
            f"bad stream key {_short(key)}: expected rankN or rankA-B (e.g. rank0, rank0-7)"
        )
    if len(match["a"]) > 9 or (match["b"] is not None and len(match["b"]) > 9):
        raise PolicyTestError(f"bad stream key {_short(key)}: rank numbers are at most 9 digits")
    first = int(match["a"])
    last = int(match["b"]) if match["b"] is not None else first
    if last < first:
        raise PolicyTestError(f"bad rank range {_short(key)}: {last} < {first}")
    if last - first + 1 > MAX_STREAM_RANKS:
        raise PolicyTestError(
            f"rank range {_short(key)} names {last - first + 1} ranks; at most {MAX_STREAM_RANKS}"
        )
    return list(range(first, last + 1))
