"""What `remedy status`, a display's progress line and the summary read of a run: read-only
views over its core and its journals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from remedy.control.decide import Controller
from remedy.control.job import JobStateMachine, Started
from remedy.control.run_core import RunCore
from remedy.control.slots import RankSlots
from remedy.policies import Engine, load_policy_text
from remedy.supervisor import status_view

POLICY = "version: 1\nname: shown\nrules: []\n"
NODE = "a42f44c0ffee0000"


def core_of(world: int = 3) -> RunCore:
    engine = Engine(load_policy_text(POLICY, "shown.yaml"), run_id="r")
    controller = Controller(engine, world_size=world)
    slots = RankSlots(world, rejected=controller.rejected)
    core = RunCore(controller, JobStateMachine(), slots, incarnation=1, started=1000.0)
    core.job.step(Started(0))
    return core


def test_status_shows_state_policy_job_slots_and_known_nodes() -> None:
    """`status` carries the progress fields, the policy in force, the job, every slot, and the
    node of each rank whose process the group has learnt."""
    core = core_of()
    core.slots.slots[0].node = NODE
    pids = {0: ("10.0.0.1", 41, 0.0), 2: ("10.0.0.2", 42, 0.0)}
    shown = status_view.status("r", "running", core, pids)
    assert shown["run_id"] == "r" and shown["state"] == "running"
    assert shown["policy"] == "shown"
    assert shown["job"] == core.job.state.to_dict()
    assert len(shown["slots"]) == 3
    assert shown["nodes"] == {"0": "a42f44c0@10.0.0.1", "2": "10.0.0.2"}
    assert shown["recent_decisions"] == [] and shown["decisions"] == 0


def test_the_progress_line_leaves_out_slots_and_nodes() -> None:
    """What a display polls every half second: no per-rank slot records, no nodes."""
    fields = status_view.progress_fields("starting", core_of())
    assert set(fields) == {"state", "step", "anomalies", "actions", "wall_s"}


def test_a_rank_without_a_known_process_has_no_node() -> None:
    """A rank the group has not learnt (no pid yet) has no node; one without a node id its
    address alone."""
    slots = core_of().slots
    assert status_view.node_of({}, slots, 1) is None
    assert status_view.node_of({1: ("10.0.0.3", 7, 0.0)}, slots, 1) == "10.0.0.3"


def test_a_decision_is_shown_briefly() -> None:
    """`status` shows a decision's id, step, rule, action, outcome and reason only."""
    d = {"decision_id": "d1", "step": 4, "rule": "x", "action": "rollback",
         "outcome": "applied", "reason": "why", "params": {"to": 2}, "ranks": [0]}  # fmt: skip
    assert status_view.brief(d) == {k: d[k] for k in
                                    ("decision_id", "step", "rule", "action", "outcome", "reason")}  # fmt: skip


def history(path: Path, *records: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def note(began: float, ended: float, by: str, silent: str = "supervisor") -> dict[str, Any]:
    return {"began": began, "noticed": began + 1, "killed": None, "ended": ended,
            "duration_s": ended - began, "noticed_by": by, "how": "answered", "silent": silent}  # fmt: skip


def test_outages_merge_every_watchers_notes_by_kind(tmp_path: Path) -> None:
    """Overlapping notes on the supervisor are one outage with their total; an agent's are
    kept apart."""
    run = history(
        tmp_path,
        {"type": "supervisor_outage", "note": note(10.0, 14.0, "rank 0")},
        {"type": "supervisor_outage", "note": note(12.0, 15.0, "driver")},
        {"type": "supervisor_outage", "note": note(30.0, 31.0, "rank 1", silent="agent")},
        {"type": "run_ended", "status": "completed"},
    )
    fields = status_view.outage_fields(run)
    assert [(o["began"], o["ended"]) for o in fields["supervisor_outages"]] == [(10.0, 15.0)]
    assert fields["supervisor_outage_s"] == 5.0
    assert len(fields["agent_outages"]) == 1


def test_skipped_journal_lines_are_summed_over_every_restore(tmp_path: Path) -> None:
    """The damaged journal.wal lines each restore skipped, summed over the run's restores."""
    run = history(
        tmp_path,
        {"type": "supervisor_restored", "skipped_records": [3, 9]},
        {"type": "supervisor_restored", "skipped_records": []},
        {"type": "supervisor_restored", "skipped_records": [12]},
    )
    assert status_view.skipped_records(run) == 3
    assert status_view.skipped_records(tmp_path / "none") == 0
