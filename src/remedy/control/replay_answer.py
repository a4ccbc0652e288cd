"""The answer to a replay the ranks hold for.

A `replay_step` decision has the ranks replay the flagged step and classify
what they saw; they then hold at their boundary for the answer. Once every
rank has applied it, the classification goes to the policy as an anomaly
(`replay_event`) and every rank gets a `<decision>-answer` command naming it,
what the policy decided about it, and the ranks a restart replaces (the
survivors then wait for the group to re-form): `answer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from remedy.policies import AnomalyEvent, Decision, EventError
from remedy.protocol.commands import Command, Outcome

if TYPE_CHECKING:
    from remedy.control.decide import Controller

log = structlog.get_logger("remedy.control")


def answer(c: Controller, d: Decision, outcome: Outcome) -> Command:
    """Decide on replay `d`'s classification (in `outcome`'s result); the answer command.

    The classification is recorded and decided like any anomaly (`Controller.handle`);
    a restart it decides is among `c.deferred` from then on.
    """
    ev = replay_event(outcome.result.get("verdict"), c._tick(), c.now, d)
    deferred = set(c.deferred)
    decided: list[Decision] = []
    if ev is not None:
        c._record(ev)
        decided = c.engine.decide([c._stamped(ev)], now=c.now)
        c.handle(decided)
    restarts = [
        x for i, x in c.deferred.items() if i not in deferred and x.action == "restart_rank"
    ]
    text = {
        "classification": ev.kind if ev is not None else None,
        "actions": [
            {"action": x.action, "rule": x.rule, "ranks": list(x.ranks)}
            for x in decided
            if not (x.suppressed or x.dry_run)
        ],
        "restart": sorted({r for x in restarts for r in x.ranks}),
    }
    c._seq += 1
    return Command(
        d.decision_id + "-answer",
        "replay_step",
        {"answer": text},
        max(c.step_of.values(), default=0),
        d.anomaly.step,
        apply_at_tick=c._tick(),
        seq=c._seq,
    )


def replay_event(verdict: Any, tick: int, now: float, d: Decision) -> AnomalyEvent | None:
    """The anomaly a replay's classification is (`workers.replay.classify`), or None if the
    ranks' result does not hold one. Checked like any event from a rank."""
    if not isinstance(verdict, dict):
        return None
    details = {
        "reason": verdict.get("reason"),
        "replay_decision": d.decision_id,
        "anomaly": {"kind": d.anomaly.kind, "rank": d.anomaly.rank, "step": d.anomaly.step},
        "replay_s": verdict.get("replay_s"),
        "evidence": verdict.get("evidence"),
    }
    raw = {
        "kind": verdict.get("kind"),
        "rank": verdict.get("rank"),
        "step": verdict.get("step"),
        "tick": tick,
        "severity": "warning" if verdict.get("kind") == "replay_reproducible" else "critical",
        "ts": now,
        "details": details,
    }
    try:
        return AnomalyEvent.from_dict(raw)
    except EventError as exc:
        log.warning("replay_verdict_rejected", error=str(exc))
        return None
