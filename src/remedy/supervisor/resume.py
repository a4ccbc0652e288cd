"""A restarted supervisor picks its run up: who it is, and the state it resumes from.

The supervisor's state lives in `journal.wal` (`control.record`). When Ray
restarts the actor after a crash, its constructor reads that journal back
(`read_back`): the newest state record, what a journal of schema 7 or older
holds besides, and which supervisor of the run this one is
(`supervisor.lineage`, `control.identity`: the claim, the decision ids
given, Ray and, where the journal is lost or behind, the ranks). `restore`
rebuilds the run's core from it and journals the outage; `took_over` journals
how the supervisor before this one died and, where the journal was lost or
behind, sets the core to the group the ranks describe.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import structlog

from remedy.control import decide_state as control_state
from remedy.control.identity import Lineage, RankResume, journal_behind, plan_resume, with_rank_ids
from remedy.control.job import JobState
from remedy.control.record import RunRecord
from remedy.control.run_core import RunCore
from remedy.protocol.spec import RunSpec
from remedy.rundir.claim import claimed_supervisors
from remedy.rundir.journals import goodput_of, last_written, read_journal
from remedy.rundir.writer import RunDir
from remedy.supervisor.death_cause import describe
from remedy.supervisor.lineage import applied_ids, ask_ranks, death_of, take_over, was_restarted
from remedy.supervisor.lineage import read_lineage as lineage_of

log = structlog.get_logger("remedy.supervisor")

# A plan to take the ranks over (or None where they could not say), and the journal
# record saying why the journal was not enough.
Takeover = tuple[RankResume | None, dict[str, Any]]


@dataclass
class ReadBack:
    """What a starting supervisor read of its run: journal.wal's newest state record (`run`),
    what an older journal holds besides (`older`, `tail`), the damaged lines it skipped, who
    this supervisor is (`lineage`) and, where the journal is lost or behind, the ranks' word."""

    run: RunRecord | None
    older: control_state.OlderTail
    tail: list[dict[str, Any]]
    skipped: list[int]
    lineage: Lineage
    takeover: Takeover | None


def read_back(spec: RunSpec, run_dir: RunDir) -> ReadBack:
    """Read journal.wal and the other sources of who this supervisor is (0 lives: a new run)."""
    skipped: list[int] = []  # journal.wal's lines skipped as damaged
    journal = read_journal(run_dir.path / "journal.wal", skipped)
    state, tail = control_state.split_at_last_state(journal)
    run = RunRecord.from_record(state) if state is not None else None  # older ones migrated
    older = control_state.older_tail(journal, tail)
    # Supervisors of this run before this one, by the highest count of any source that
    # remembers (`control.identity`): the newest state record's (or, in a journal of
    # schema 7 or older, its `supervisor_started` records), the claim, the decision ids
    # given, Ray; where the journal is lost or behind, the ranks too. 0 for a new run.
    lineage, takeover = _lineage(
        spec,
        run_dir,
        max(run.incarnation if run is not None else 0, older.lives),
        run.controller.get("seq", 0) if run is not None else 0,
    )
    return ReadBack(run, older, tail, skipped, lineage, takeover)


def _lineage(
    spec: RunSpec, run_dir: RunDir, journal_lives: int, journal_seq: int
) -> tuple[Lineage, Takeover | None]:
    """Who this supervisor is (`control.identity`), and, where journal.wal is lost or
    older than the run, what the ranks told (a plan to take them over, or None, and the
    journal record saying so)."""
    lineage = lineage_of(run_dir.path, journal_lives, restarted=was_restarted())
    if not lineage.lives:
        return lineage, None
    answers = ask_ranks(spec.run_id)
    lineage = with_rank_ids(lineage, applied_ids(answers))
    behind = journal_behind(journal_seq, answers)
    if not (lineage.journal_lost or behind):
        return lineage, None
    plan = plan_resume(spec.workers, answers)
    record: dict[str, Any] = {
        "type": "journal_lost",
        "why": "journal.wal is older than the run" if behind and not lineage.journal_lost
        else "journal.wal holds fewer supervisors than the run had",
        "sources": lineage.sources(),
        "ranks_answered": sorted(answers),
        "resumed_from_ranks": plan is not None,
    }  # fmt: skip
    if plan is not None:
        record.update(generation=plan.generation, steps={str(r): s for r, s in plan.steps.items()},
                      command_seq=plan.command_seq)  # fmt: skip
    return lineage, (plan, record)


def took_over(core: RunCore, run_dir: RunDir, back: ReadBack) -> None:
    """Journal how the supervisor before this one died (as Ray says) and how this one knew
    it was not new; take the ranks over where the journal was lost or behind and they
    could say where they are."""
    lineage = back.lineage
    pid = claimed_supervisors(run_dir.path).get(lineage.lives)
    death = death_of(pid) if pid is not None else describe(None, None, (False, None))
    run_dir.history({
        "type": "supervisor_died", "incarnation": lineage.lives, "pid": pid, **death,
    })  # fmt: skip
    if back.takeover is None:
        return
    plan, record = back.takeover
    if plan is not None:
        take_over(core, plan)
    record["incarnation"] = lineage.incarnation
    run_dir.history(record)
    log.warning("journal_lost", **{k: v for k, v in record.items() if k != "type"})


def restore(core: RunCore, run_dir: RunDir, back: ReadBack, run_id: str) -> dict[str, Any] | None:
    """Rebuild `core` from journal.wal's newest state record (and, from a journal of schema 7
    or older, what it holds besides). Returns the summary of a run that had ended, else None."""
    run, older, tail = back.run, back.older, back.tail
    ended = run.ended if run is not None and run.ended is not None else older.ended
    if ended is not None:
        core.ended = ended
        return {"status": ended, **read_summary(run_dir, run_id, ended)}
    c = core.controller
    if run is not None:
        core.restore(run, time.time())
    if not core.ranks_ended and older.ranks_ended is not None:
        core.results_ended(older.ranks_ended)
    abandoned = control_state.replay_tail(c, tail)  # a journal of schema 7 or older
    if older.job is not None:
        core.job.state = JobState.from_dict(older.job)
    c.restore_decisions(read_journal(run_dir.path / "decisions.jsonl"))
    abandoned += control_state.abandoned(c, read_journal(run_dir.path / "history.jsonl"))
    # The goodput ledger from the journals; the outage, from when the supervisor that
    # died last wrote something (a report's metrics, a journal record) until now.
    c.goodput = goodput_of(run_dir.path)
    heard = [last_written(run_dir.path / n)
             for n in ("metrics.jsonl", "journal.wal", "history.jsonl")]  # fmt: skip
    back_at = time.time()
    down_since = max((t for t in heard if t is not None), default=back_at)
    outage = {
        "incarnation": core.incarnation,
        "down_since": round(down_since, 3),
        "back_at": round(back_at, 3),
        "down_s": round(max(back_at - down_since, 0.0), 3),
    }
    c.goodput.outage(outage)
    run_dir.history(
        {
            "type": "supervisor_restored",
            "incarnation": core.incarnation,
            "from_state": run is not None,
            "tail_records": len(tail),
            # Damaged lines of journal.wal skipped (line numbers, from 1).
            "skipped_records": list(back.skipped),
            "abandoned": sorted(set(abandoned)),
            "pending": sorted(c.pending),
            "job": core.job.state.to_dict(),
            "outage": outage,
        }
    )
    log.warning(
        "supervisor_restored",
        incarnation=core.incarnation,
        pending=len(c.pending),
        abandoned=len(abandoned),
    )
    return None


def read_summary(run_dir: RunDir, run_id: str, status: str) -> dict[str, Any]:
    """The ended run's summary.json, or the least one where it cannot be read."""
    try:
        summary = json.loads((run_dir.path / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict):
        summary = {"run_id": run_id, "status": status}
    return summary
