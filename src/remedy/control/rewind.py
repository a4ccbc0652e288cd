"""A rewind of every rank, and a lost rank: what they settle in the book of pending commands.

A full-group restart from a checkpoint (or from the start) redoes the steps
from there on: a pending rewind of an anomaly in them is carried out by it
(`rewound`). A lost rank leaves the targets of every pending command, so a
decision resolves on the live ranks, and a disruptive one still waiting
gives up the disruption budget for the restart that brings the rank back
(`drop_rank`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remedy.control.command_book import close, internal, resolve
from remedy.control.decision_journal import journal
from remedy.control.effects import HistoryRecord
from remedy.control.goodput import REWINDING_ACTIONS
from remedy.policies import DISRUPTIVE_ACTIONS

if TYPE_CHECKING:
    from remedy.control.decide import Controller


def rewound(c: Controller, tick: int, resumed: str) -> list[str]:
    """Every rank restarted from tick `tick` (`resumed`: from where, as a sentence's end).

    The steps from there on run again, so what was decided on them is settled
    by the restart: a pending rewind (a rollback) of an anomaly at or after
    `tick` is applied by it, since no rank holds any state from after it any
    more (the new ranks would otherwise rewind again at their first boundary,
    and skip batches that were never bad). An anomaly that comes again in the
    redone steps is a new incident, decided anew. Returns the decisions settled.
    """
    c.incidents.rewound(tick)
    settled = []
    for pending in list(c.pending.values()):
        d = pending.decision
        if internal(d.decision_id) or d.action not in REWINDING_ACTIONS or d.anomaly.tick < tick:
            continue
        detail = (
            f"carried out by the full-group restart: every rank resumed {resumed}, before "
            f"this anomaly's step {d.anomaly.step}; the steps after it run again, and an "
            "anomaly that comes again there is decided anew"
        )
        close(c, d.decision_id)
        c._emit(
            HistoryRecord({"type": "resolved", "decision_id": d.decision_id, "outcome": "applied"})
        )
        follow = c.engine.record_outcome(d.decision_id, "applied", tick=c._tick(), detail=detail)
        journal(c, d, "applied", detail=detail, apply_at_step=pending.command.apply_at_step)
        c.handle(follow)
        settled.append(d.decision_id)
    return settled


def drop_rank(c: Controller, rank: int) -> list[str]:
    """A rank was lost: it leaves the targets of every pending command.

    A decision then resolves once every live target has answered. A
    disruptive one (a rollback) still waiting for others gives up the
    disruption budget, so the `restart_rank` that brings the lost rank back
    is not held behind it (the rollback still completes on the live ranks,
    and a replacement adopts it with the survivors' state). Returns the
    pre-empted decision ids.
    """
    preempted = []
    c.changes += 1
    for pending in list(c.pending.values()):
        if rank not in pending.targets:
            continue
        pending.targets.discard(rank)
        pending.outcomes.pop(rank, None)
        pending.dropped.add(rank)
        decision_id = pending.command.decision_id
        if internal(decision_id):
            if set(pending.outcomes) >= pending.targets:
                del c.pending[decision_id]
            continue
        failed = [o for o in pending.outcomes.values() if o.outcome != "applied"]
        if pending.targets and (failed or set(pending.outcomes) >= pending.targets):
            resolve(c, pending, failed)
        elif pending.decision.action in DISRUPTIVE_ACTIONS:
            c.engine._budget.release(decision_id)
            preempted.append(decision_id)
    return preempted
