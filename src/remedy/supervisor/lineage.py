"""A starting supervisor reads who it is: the shell's side of `control.identity`.

It reads the run directory's sources (the claim, decisions.jsonl,
history.jsonl), asks Ray whether this actor was restarted, and asks the
rank actors still alive what they know (`RankActor.identity`). Where the
journal is lost or older than the run, `take_over` sets the run's core to
the ranks' group: their actors, incarnations, generation and report
numbers, with new command numbers above any they hold.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import structlog

from remedy.control.identity import Lineage, RankResume
from remedy.control.job import JobState, Phase
from remedy.control.run_core import GroupMoved
from remedy.protocol.spec import NAMESPACE
from remedy.rundir.claim import claimed_lives
from remedy.rundir.journals import read_journal
from remedy.supervisor.death_cause import describe, kernel_oom_kill
from remedy.supervisor.worker_group import run_actor_names

if TYPE_CHECKING:
    from remedy.control.run_core import RunCore

log = structlog.get_logger("remedy.supervisor")

# How long the ranks get to say who they are, on every restart of the supervisor (as long
# as a rank gets to answer `result()`, `worker_group.RESULT_TIMEOUT_S`): a rank that answers
# nothing (stopped, wedged) leaves the group as the journal had it.
ASK_RANKS_S = 2.0


def was_restarted() -> bool:
    """Whether Ray restarted this actor (a supervisor of this run lived before it)."""
    with contextlib.suppress(Exception):  # outside an actor (a test): not restarted
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    return False


def read_lineage(path: Path, journal_lives: int, *, restarted: bool) -> Lineage:
    """What the run directory's sources besides journal.wal say of earlier supervisors."""
    ids = tuple(
        str(d["decision_id"])
        for d in read_journal(path / "decisions.jsonl")
        if isinstance(d.get("decision_id"), str)
    )
    started = [
        r.get("incarnation")
        for r in read_journal(path / "history.jsonl")
        if r.get("type") == "supervisor_started"
    ]
    return Lineage(
        journal_lives=journal_lives,
        claim_lives=claimed_lives(path),
        history_lives=max((n for n in started if type(n) is int), default=0),
        seen_ids=ids,
        restarted=restarted,
    )


def ask_ranks(run_id: str, timeout_s: float = ASK_RANKS_S) -> dict[int, tuple[str, dict[str, Any]]]:
    """rank -> (the name of its newest actor, what it says of itself), for the rank actors of
    `run_id` alive and answering within `timeout_s`."""
    prefix = f"remedy-rank-{run_id}-"
    newest: dict[int, tuple[int, str]] = {}
    for name in run_actor_names(run_id):
        if not name.startswith(prefix):
            continue
        rank_s, _, inc_s = name[len(prefix) :].rpartition("-i")
        if not (rank_s.isdigit() and inc_s.isdigit()):
            continue
        rank, inc = int(rank_s), int(inc_s)
        if inc > newest.get(rank, (-1, ""))[0]:
            newest[rank] = (inc, name)
    refs: dict[Any, tuple[int, str]] = {}
    for rank, (_, name) in newest.items():
        with contextlib.suppress(ValueError):  # gone meanwhile
            actor = ray.get_actor(name, namespace=NAMESPACE)
            refs[actor.identity.remote()] = (rank, name)
    if not refs:
        return {}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    out: dict[int, tuple[str, dict[str, Any]]] = {}
    for ref in ready:
        rank, name = refs[ref]
        try:
            answer = ray.get(ref)  # ready: ray.wait returned it
        except ray.exceptions.RayError as exc:
            log.warning("rank_identity_unknown", rank=rank, error=repr(exc)[:200])
            continue
        if isinstance(answer, dict) and answer.get("run_id") == run_id:
            out[rank] = (name, answer)
    return out


def applied_ids(answers: dict[int, tuple[str, dict[str, Any]]]) -> list[str]:
    """Every decision id the ranks say they applied (the newest of each incarnation)."""
    return [
        str(i) for _, a in answers.values() for i in (a.get("applied") or []) if isinstance(i, str)
    ]


def death_of(pid: int) -> dict[str, Any]:
    """How the worker process `pid` of this cluster ended: Ray's exit type and detail (None
    where Ray holds no record of it) and, from them and the kernel log, its `cause` and a
    `reason` in words (`death_cause`)."""
    record = ray_death(pid)
    since = record.get("started_at") if record is not None else None
    return {
        **(record or {"exit_type": None, "exit_detail": "Ray holds no record of its end"}),
        **describe(pid, record, kernel_oom_kill(pid, since=since)),
    }


def ray_death(pid: int) -> dict[str, Any] | None:
    """How Ray says the worker process `pid` of this cluster ended (its exit type and detail,
    and when it started, in seconds since the epoch), or None where it holds no record of it.
    Read from the GCS's worker table, which Ray fills when a worker dies: the private API is
    guarded, an answer is never required."""
    try:
        from ray._private.state import state  # noqa: PLC0415 - only after a restart
        from ray.core.generated import common_pb2, gcs_pb2  # noqa: PLC0415

        table = state._connect_and_get_accessor().get_worker_table()
        for raw in table:
            worker = gcs_pb2.WorkerTableData.FromString(raw)  # type: ignore[attr-defined]
            if worker.pid == pid and not worker.is_alive:
                return {
                    "exit_type": common_pb2.WorkerExitType.Name(  # type: ignore[attr-defined]
                        worker.exit_type
                    ),
                    "exit_detail": worker.exit_detail[:500],
                    "started_at": worker.start_time_ms / 1000 if worker.start_time_ms else None,
                }
    except Exception as exc:  # another Ray version: the death goes unexplained, not the restart
        log.warning("death_not_read", pid=pid, error=repr(exc)[:200])
    return None


def take_over(core: RunCore, plan: RankResume) -> None:
    """Set `core` to the ranks' group as `plan` describes it (the journal lost or behind)."""
    core.step(GroupMoved(plan.group_section()))
    for rank in core.slots.slots:
        core.slots.resume_at(rank, plan.incarnations[rank], plan.last_seq[rank])
    core.controller.advance_command_seq(plan.command_seq)
    core.job.state = JobState(Phase.RUNNING, plan.generation)
