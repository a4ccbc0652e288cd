"""What the supervisor shows of its run: `remedy status`, a display's progress line, the outages.

Read-only views over the run's core, its rank slots and the run directory's
journals; nothing here changes what it reads. The supervisor answers its
`status` and `events` calls with them and puts the outages and skipped
journal lines in the run's summary (`supervisor.summary`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from remedy.control.run_core import RunCore
from remedy.control.slots import RankSlots
from remedy.rank.link import liveness
from remedy.rundir.journals import read_journal
from remedy.supervisor import placement

# Decisions `status` shows, newest last.
RECENT_DECISIONS = 5

# rank -> (node address, pid, start time) of its current process, as the worker group learnt it.
Pids = dict[int, tuple[str, int, float]]


def progress_fields(state: str, core: RunCore) -> dict[str, Any]:
    """The part of `status` a display's progress line reads (`Feed.progress`): the poll
    every half second leaves out the per-rank slot records and nodes (at 4,096 ranks
    they were most of what a poll cost, and blocked the supervisor's loop meanwhile)."""
    c = core.controller
    return {
        "state": state,
        "step": dict(c.step_of),
        "anomalies": dict(c.anomaly_counts),
        "actions": dict(c.action_counts),
        "wall_s": round(time.time() - core.started, 1),
    }


def status(run_id: str, state: str, core: RunCore, pids: Pids) -> dict[str, Any]:
    """The run's state, step per rank, counts and the policy in force (`remedy status`)."""
    c = core.controller
    return {
        "run_id": run_id,
        **progress_fields(state, core),
        "loss": c.final_loss(),
        "decisions": len(c.decisions),
        "rejected_events": c.rejected_events,
        "rejected": dict(c.rejected),
        "stop_reason": c.stop_reason,
        "recent_decisions": [brief(d) for d in c.decisions[-RECENT_DECISIONS:]],
        "policy": c.engine.policy.name,
        "job": core.job.state.to_dict(),
        "slots": core.slots.records(),
        "nodes": rank_nodes(pids, core.slots),
    }


def brief(d: dict[str, Any]) -> dict[str, Any]:
    """A journaled decision as `status` shows it."""
    keys = ("decision_id", "step", "rule", "action", "outcome", "reason")
    return {k: d.get(k) for k in keys}


def node_of(pids: Pids, slots: RankSlots, rank: int) -> str | None:
    """The node `rank`'s current process runs on, once the group has learnt it.

    Its Ray node id's first 8 hex digits and its address (`placement.label`),
    or the address alone where the node id is not known.
    """
    where = pids.get(rank)
    if where is None:
        return None
    slot = slots.slots.get(rank)
    return placement.label(slot.node, where[0]) if slot and slot.node else where[0]


def rank_nodes(pids: Pids, slots: RankSlots) -> dict[str, str]:
    """rank -> the node label of its current process (`placement.label`), where known."""
    out = {}
    for rank in sorted(slots.slots):
        node = node_of(pids, slots, rank)
        if node is not None:
            out[str(rank)] = node
    return out


def outage_fields(run_path: Path) -> dict[str, Any]:
    """The summary's outages so far, merged from every watcher's notes in the journal (read
    once): the supervisor's with their total, and the node agents' their ranks noticed."""
    history = read_journal(run_path / "history.jsonl")
    notes = [r["note"] for r in history if r.get("type") == "supervisor_outage"]
    outages = liveness.merge_outages(notes)
    return {
        "supervisor_outages": outages,
        "supervisor_outage_s": round(sum(o["duration_s"] for o in outages), 3),
        # A node agent its ranks found silent (a crash and Ray's restart of it, a hang).
        "agent_outages": liveness.merge_outages(notes, "agent"),
    }


def skipped_records(run_path: Path) -> int:
    """journal.wal's damaged lines skipped by every restore of this run (the history's)."""
    restored = [r for r in read_journal(run_path / "history.jsonl")
                if r.get("type") == "supervisor_restored"]  # fmt: skip
    return sum(len(r.get("skipped_records") or []) for r in restored)
