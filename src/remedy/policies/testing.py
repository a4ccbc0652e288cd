"""Helpers for testing policies in pytest, the way `remedy policy test` does.

    from remedy.policies.testing import stream, run_stream, assert_decisions

    events = stream("nonfinite_loss", "_x100 1x3", ranks=range(8))
    decisions = run_stream("default", events)
    assert_decisions(decisions, {101: ["rollback", "shrink_lr"]})

`run_stream` feeds the events to an `Engine` one tick at a time and, like a
healthy worker group, records every decision it carries out as applied at
the tick it was made (so the disruption budget frees and inhibit warm-ups
start); `outcomes` overrides that per (step, action) with "failed" or
"none" (left in flight).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

from remedy.policies._engine import Engine
from remedy.policies._events import AnomalyEvent, Decision
from remedy.policies._loader import load_policy
from remedy.policies._rules import Policy
from remedy.policies._streams import parse_pattern, pattern_events

__all__ = [
    "actions_by_step",
    "assert_decisions",
    "batches",
    "diff_decisions",
    "parse_pattern",
    "run_stream",
    "stream",
]

Outcomes = Mapping[tuple[int, str], str | tuple[str, str]]


def stream(
    kind: str,
    pattern: str,
    *,
    ranks: Iterable[int] = (0,),
    start_step: int = 1,
    severity: str = "warning",
    threshold: float | None = None,
    source: str = "detector",
    step_seconds: float = 1.0,
) -> list[AnomalyEvent]:
    """Events of one kind following a compact pattern such as ``"_x100 1x3 _x50"``."""
    return pattern_events(
        kind,
        pattern,
        ranks,
        start_step=start_step,
        severity=severity,
        threshold=threshold,
        source=source,
        step_seconds=step_seconds,
    )


def batches(events: Iterable[AnomalyEvent]) -> list[list[AnomalyEvent]]:
    """Events grouped into one batch per tick, in tick order (stable within a tick)."""
    by_tick: dict[int, list[AnomalyEvent]] = {}
    for event in events:
        by_tick.setdefault(event.tick, []).append(event)
    return [by_tick[t] for t in sorted(by_tick)]


def run_stream(
    policy: Policy | str | os.PathLike[str],
    events: Iterable[AnomalyEvent],
    *,
    run_id: str = "test",
    dry_run: bool = False,
    auto_apply: bool = True,
    outcomes: Outcomes | None = None,
    engine: Engine | None = None,
) -> list[Decision]:
    """All decisions (suppressed ones included) for a stream, with outcomes recorded.

    `outcomes` maps (step, action) to "applied", "failed", ("failed", detail)
    or "none"; other carried-out decisions are recorded as applied when
    `auto_apply` is true. As the supervisor's dispatcher does, a failed step
    stops the rest of its chain unless it says `on_failure: next`; the steps
    so dropped are not carried out and are left out of the result. Follow-ups
    from failures are appended after the batch's decisions.
    """
    if engine is None:
        loaded = policy if isinstance(policy, Policy) else load_policy(policy)
        engine = Engine(loaded, run_id=run_id, dry_run=dry_run)
    out: list[Decision] = []
    for batch in batches(events):
        tick = batch[0].tick
        queue = engine.decide(batch)
        dropped: set[str] = set()
        i = 0
        while i < len(queue):
            decision = queue[i]
            i += 1
            if decision.decision_id in dropped:
                continue
            out.append(decision)
            if decision.suppressed or decision.dry_run:
                continue
            choice = (outcomes or {}).get((decision.step, decision.action))
            if choice is None:
                choice = "applied" if auto_apply else "none"
            outcome, detail = choice if isinstance(choice, tuple) else (choice, "")
            if outcome == "none":
                continue
            if outcome == "failed" and decision.ends_chain_on_failure:
                # Like the dispatcher: a failed step stops the rest of its chain (unless it
                # says `on_failure: next`); those decisions are not carried out.
                dropped.update(d.decision_id for d in queue[i:] if d.chain_id == decision.chain_id)
            queue.extend(
                engine.record_outcome(decision.decision_id, outcome, tick=tick, detail=detail)
            )
    return out


def actions_by_step(
    decisions: Iterable[Decision], *, suppressed: bool = False
) -> dict[int, list[str]]:
    """Step -> actions decided at that step, in order (suppressed ones only if asked)."""
    out: dict[int, list[str]] = {}
    for d in decisions:
        if d.suppressed == suppressed:
            out.setdefault(d.step, []).append(d.action)
    return out


def diff_decisions(
    decisions: Sequence[Decision],
    expected: Mapping[int, Sequence[str]],
    *,
    exhaustive: bool = True,
) -> list[str]:
    """Readable differences between expected and actual actions per step (empty if equal)."""
    got = actions_by_step(decisions)
    steps = sorted(set(expected) | (set(got) if exhaustive else set()))
    lines: list[str] = []
    for step in steps:
        want = list(expected.get(step, []))
        have = got.get(step, [])
        if want != have:
            lines.append(f"step {step}: expected {want}, got {have}")
            lines.extend(
                f"    {d.action} (rule {d.rule}): {d.reason}"
                for d in decisions
                if d.step == step and not d.suppressed
            )
    return lines


def assert_decisions(
    decisions: Sequence[Decision],
    expected: Mapping[int, Sequence[str]],
    *,
    exhaustive: bool = True,
) -> None:
    """Assert the carried-out actions per step; with `exhaustive`, no other step has any."""
    lines = diff_decisions(decisions, expected, exhaustive=exhaustive)
    if lines:
        raise AssertionError("decisions differ from expected:\n" + "\n".join(lines))
