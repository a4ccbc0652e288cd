"""The run's summary (`summary.json`): what the supervisor writes when the run ends.

One function over what the run ended with: the core (controller counts,
job state, slots), the ranks' results, the shell's counters (pings, agent
kills and promotions, sightings, notifications) and the run directory's
journals (outages, skipped journal lines). The fields are ARCHITECTURE.md's
`summary.json` contract and what `remedy report` and `explain` read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remedy.control.run_core import RunCore
from remedy.control.sightings import Sightings
from remedy.protocol.spec import RunSpec
from remedy.supervisor.recovery import Recovery
from remedy.supervisor.status_view import outage_fields, rank_nodes, skipped_records
from remedy.supervisor.worker_group import WorkerGroup


def end_summary(
    spec: RunSpec,
    core: RunCore,
    results: list[dict[str, Any]],
    status: tuple[str, str | None],
    *,
    ended: float,
    run_path: Path,
    group: WorkerGroup | None,
    recovery: Recovery | None,
    sightings: Sightings,
    notifications: dict[str, int],
) -> dict[str, Any]:
    """The summary of a run that ended at `ended` with `status` (and why it is degraded, if)."""
    c = core.controller
    lead = results[0] if results else {}
    completed = int(lead.get("steps_completed", 0))
    # Every execution counts, the ones a rollback or a restart from a checkpoint redid
    # too; an update that was skipped (an unrelieved OOM, a non-finite step) kept nothing.
    goodput = c.goodput.summary(
        started=core.started,
        ended=ended,
        completed=completed,
        fallback_executed=int(lead.get("steps_executed", 0)),
        fallback_skipped=int(lead.get("updates_skipped", 0) or 0),
    )
    return {
        "run_id": spec.run_id,
        "status": status[0],
        "degraded_reason": status[1],
        "abort_reason": c.abort_reason,
        "stop_reason": c.stop_reason,
        "steps_completed": completed,
        **goodput,
        "final_loss": lead.get("final_loss"),
        "actions": dict(c.action_counts),
        "anomalies": dict(c.anomaly_counts),
        "outcomes": dict(c.outcome_counts),
        "notifications": dict(notifications),
        "decisions": len(c.decisions),
        "rejected_events": c.rejected_events,
        "rejected_batches": c.rejected_batches,
        "rejected": dict(c.rejected),  # refused report input, by reason
        "refused_stale_reports": core.slots.refused_stale,
        "skipped_batches": lead.get("skipped_batches", []),
        "policy": spec.policy,
        "workers": spec.workers,
        "job": core.job.state.to_dict(),
        "recoveries": recovery.records if recovery is not None else [],
        # Rank pings the supervisor sent itself (none behind node agents in steady state).
        "supervisor_pings": group.pings_sent if group is not None else 0,
        "agent_sighting_calls": sightings.calls,  # node agents' ping rounds taken in
        # Rank processes killed by pid by their node's agent, on the supervisor's order.
        "agent_kills": group.agent_kills if group is not None else 0,
        "agent_promotions": group.promotions if group is not None else 0,
        "resumed_from": spec.resume or None,
        "supervisor_restarts": core.incarnation - 1,
        # Damaged journal.wal lines the restarted supervisors skipped (`supervisor_restored`).
        "journal_skipped_records": skipped_records(run_path),
        **outage_fields(run_path),
        "wall_s": round(ended - core.started, 2),
        # Where each rank's last process ran, and the nodes lost meanwhile.
        "nodes": rank_nodes(group.pids if group is not None else {}, core.slots),
        "ranks": results,
    }
