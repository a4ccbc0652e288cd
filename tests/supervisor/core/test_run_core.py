"""The run's core, one input at a time: ranks' ends, an abort asked for, the run's status, and
its state record taken back by a new supervisor."""

from __future__ import annotations

import json
from typing import Any

import pytest

from remedy.control.decide import Controller
from remedy.control.job import (
    JobState,
    JobStateMachine,
    Phase,
    RanksLost,
    RanksUnreplaced,
    Started,
)
from remedy.control.record import RunRecord
from remedy.control.restart import RestartState, Stage
from remedy.control.run_core import (
    Answer,
    BatchesLost,
    Dropped,
    Ended,
    Ending,
    GroupMoved,
    GroupStarted,
    OperatorStop,
    OutageNotes,
    Pass,
    RankDied,
    RankEnded,
    RankReturned,
    RanksAllEnded,
    ReplacementFailed,
    Report,
    RestartMoved,
    RunCore,
    Status,
    StopAsked,
    Taken,
    ToPolicy,
    Watching,
)
from remedy.control.sections import GroupSection, HangEntry, HangSection, RestartSection
from remedy.control.slots import RankSlots
from remedy.policies import Engine, load_policy_text

NOW = 2000.0  # wall time of the state records
POLICY = """
version: 1
name: run-core-test
rules:
  - name: told
    when: {anomaly: data_stall}
    do: [notify]
"""


def make(world: int = 2, *, max_targeted: int = 3) -> RunCore:
    controller = Controller(
        Engine(load_policy_text(POLICY, "run_core.yaml"), run_id="r"), world_size=world
    )
    core = RunCore(
        controller,
        JobStateMachine(max_targeted=max_targeted),
        RankSlots(world, rejected=controller.rejected),
        incarnation=1,
        started=1000.0,
    )
    core.job.step(Started(0))
    return core


def done(rank: int, status: str = "completed", **more: Any) -> dict[str, Any]:
    return {"rank": rank, "status": status, "incarnation": 1, **more}


def test_a_rank_that_returned_is_ended_and_shown() -> None:
    core = make()
    assert core.step(RankReturned(0, 1, done(0))) == [RankEnded(0, "completed")]
    assert core.results == {0: done(0)}
    assert core.slots.slots[0].state.value == "ended"
    assert not core.all_completed()
    core.step(RankReturned(1, 1, done(1)))
    assert core.all_completed()


def test_a_failed_result_tells_a_restart_starting_that_rank() -> None:
    core = make()
    effects = core.step(RankReturned(1, 1, done(1, "failed", error="boom")))
    assert effects == [ReplacementFailed(1, "boom"), RankEnded(1, "failed")]


def test_a_replaced_processs_late_result_changes_nothing() -> None:
    core = make()
    core.slots.replace(1)  # rank 1 replaced: incarnation 2
    assert core.step(RankReturned(1, 1, done(1))) == []  # incarnation 2 runs now
    assert core.results == {}
    assert core.slots.slots[1].state.value != "ended"


def test_a_dead_process_is_a_failed_result_and_a_loss_about_that_process() -> None:
    core = make()
    effects = core.step(
        RankDied(1, 1, "rank process died: gone", "rank 1's process died", 5.0, {"x": 1})
    )
    assert effects[0] == ToPolicy(1, "rank_dead", "rank 1's process died", 5.0)
    assert core.results[1] == {"rank": 1, "status": "failed", "error": "rank process died: gone"}
    # The death of a process already replaced: no result for the new one, and the loss is
    # about nothing running now.
    core.slots.replace(0)
    stale = core.step(RankDied(0, 1, "rank process died: late", "rank 0's process died", 6.0))
    assert stale == [Dropped(0, "rank_dead", 1, 2)] and 0 not in core.results


def test_a_stop_asked_for_moves_the_job_to_aborting_once() -> None:
    core = make()
    core.step(Pass())
    assert core.job.state.phase is Phase.RUNNING
    core.controller.stop_reason = "maintenance"
    core.step(Pass())
    assert core.job.state.phase is Phase.ABORTING
    assert core.job.state.reason == "an operator's stop: maintenance"
    moves = len(core.job.history)
    core.step(Pass())
    assert len(core.job.history) == moves


def test_an_abort_waits_for_a_restart_under_way() -> None:
    core = make()
    core.job.step(RanksLost(frozenset({1}), "rank 1 hung"))
    core.controller.abort_reason = "gpu_ecc"
    core.step(Pass())
    assert core.job.state.phase is Phase.RECOVERING


@pytest.mark.parametrize(
    ("results", "asked", "error", "status"),
    [
        ([done(0), done(1)], {}, None, "completed"),
        ([done(0), done(1)], {}, "the supervisor failed: KeyError()", "failed"),
        ([done(0), done(1)], {"stop_reason": "ops"}, None, "stopped"),
        ([done(0), done(1, "aborted")], {"abort_reason": "gpu_ecc"}, None, "aborted"),
        ([done(0)], {}, None, "failed"),  # one rank never ended
        ([done(0), done(1, "failed", error="x")], {}, None, "failed"),
    ],
)
def test_the_runs_status(
    results: list[dict[str, Any]], asked: dict[str, str], error: str | None, status: str
) -> None:
    core = make()
    for r in results:
        core.step(RankReturned(r["rank"], 1, r))
    for key, value in asked.items():
        setattr(core.controller, key, value)
    assert core.step(Ending(error)) == [Status(status)]
    assert core.job.state.ended
    assert core.ended is None  # not until the summary is written
    core.step(Ended(status))
    assert core.ended == status


def test_a_rank_that_stopped_itself_aborts_the_run_for_its_reason() -> None:
    core = make()
    core.step(RankReturned(0, 1, done(0)))
    core.step(RankReturned(1, 1, done(1, "aborted", stop_reason="OOM not relieved")))
    assert core.step(Ending()) == [Status("aborted")]
    assert core.controller.abort_reason == "OOM not relieved"
    assert core.job.state.phase is Phase.ABORTED


def test_a_degraded_job_ends_for_the_reason_it_degraded() -> None:
    core = make()
    core.job.step(RanksUnreplaced(frozenset({1}), "rank 1 hung; not replaced: notify"))
    core.step(RankReturned(0, 1, done(0, "failed", error="peer gone")))
    assert core.step(Ending()) == [Status("failed")]
    assert core.job.state.phase is Phase.FAILED
    assert "not replaced: notify" in core.job.state.reason


def test_the_state_record_is_taken_back_whole_by_a_new_supervisor() -> None:
    """Every section comes back: crash points, results, the group's and the hang watch's."""
    core = make()
    core.slots.accept(0, 1, 1)
    core.step(RankReturned(0, 1, done(0)))
    core.step(RankReturned(1, 1, done(1)))
    core.ranks_ended = True
    assert core.crash_due("after_decision", ["after_decision"])
    assert not core.crash_due("after_decision", ["after_decision"])  # once per run
    assert not core.crash_due("before_kill", [])
    group = GroupSection(0, {0: "a0", 1: "a1"}, spares=("s1",), next_spare=1)
    core.step(GroupMoved(group))
    core.step(Watching(0.0))
    core.watch.beat(0, 0, 0.0)
    core.watch.beat(0, 2, 1.0)
    record = json.loads(json.dumps(core.record(NOW).to_record()))  # as journal.wal holds it
    assert record["group"] == group.to_json() and record["recovery"] is None
    assert record["hang"] == {"0": [0.0, 2]}
    assert record["ranks_ended"] == {"0": done(0), "1": done(1)}

    again = make()
    again.incarnation = 2
    again.restore(RunRecord.from_record(record))
    assert again.crashed == {"after_decision"}
    assert again.ranks_ended and again.results == {0: done(0), 1: done(1)}
    assert again.group == group
    assert again.hang == HangSection({0: HangEntry(0.0, 2)}) and not again.watching
    assert json.loads(json.dumps(again.record(NOW).to_record())) == {**record, "incarnation": 2}


def test_a_restored_hang_watch_gives_each_rank_its_own_timeout_and_writes_it_back() -> None:
    """Rank 0's entry says a p99 step time of 0.2 s, its first steps behind it: watched with
    its own timeout from the restart. Rank 1 never reported a step: the start-up allowance.
    Until the watch takes the ranks in, the record holds the restored entries; after, the
    watch's, which are the same."""
    core = make()
    core.controller.ingest({"rank": 0, "step": 7, "tick": 7}, answer=False)
    core.step(Watching(0.0))
    for tick in range(8, 12):
        core.watch.beat(0, tick, 0.0, [0.2])
    record = json.loads(json.dumps(core.record(NOW).to_record()))
    again = make()
    again.restore(RunRecord.from_record(record))
    assert again.hang == HangSection({0: HangEntry(0.2, 3)})
    assert again.record(NOW).to_record()["hang"] == {"0": [0.2, 3]}
    assert again.watch.knows(0) is False  # not watched before the loop says so
    again.controller.ingest({"rank": 0, "step": 11, "tick": 11}, answer=False)
    assert again.step(Watching(50.0)) == []
    config = again.watch.config
    assert again.watch.timeout(0) == max(config.floor_s, config.step_multiple * 0.2)
    assert again.watch.timeout(1) == config.startup_s
    assert again.record(NOW).to_record()["hang"] == {"0": [0.2, 3]}


def test_restored_slots_count_their_refusals_where_the_summary_reads_them() -> None:
    core = make()
    core.slots.accept(1, 1, 5)
    again = make()
    again.restore(RunRecord.from_record(json.loads(json.dumps(core.record(NOW).to_record()))))
    assert not again.slots.accept(1, 1, 5)  # a duplicate
    assert not again.slots.accept(1, 7, 6)  # an incarnation never started
    assert again.controller.rejected["batch_duplicate_seq"] == 1
    assert again.controller.rejected["batch_stale_incarnation"] == 1


def test_the_restart_section_is_the_cores_and_is_written_with_the_losses() -> None:
    """No restart built: no `recovery` section. The shell moves the restart's section; the
    record writes it beside the losses' part, and a new supervisor takes it back whole."""
    core = make()
    assert core.record(NOW).to_record()["recovery"] is None
    section = RestartSection({"restart": 1.0}, RestartState("d1", 2, Stage.LAUNCH, (1,)))
    assert core.step(RestartMoved(section)) == []
    record = json.loads(json.dumps(core.record(NOW).to_record()))
    assert record["recovery"] == {**section.to_json(), **core.lost.record({}, NOW)}
    again = make()
    again.restore(RunRecord.from_record(record))
    assert again.restart == section and again.record(NOW) == core.record(NOW)


def test_a_group_started_over_starts_the_job_over() -> None:
    core = make()
    core.restart_job()
    assert core.job.state == JobState()


def batch(rank: int, seq: int, tick: int, incarnation: int = 1, **more: Any) -> dict[str, Any]:
    return {"rank": rank, "incarnation": incarnation, "seq": seq, "step": tick, "tick": tick,
            **more}  # fmt: skip


def test_a_ranks_report_is_taken_once_and_answered() -> None:
    core = make()
    effects = core.step(Report(batch(0, 1, 3)))
    assert [type(e) for e in effects] == [Taken, Answer]
    assert (effects[0].rank, effects[0].tick, effects[1]) == (0, 3, Answer(0))
    assert core.controller.tick_of[0] == 3
    # The same call again (Ray retried it after a restart): answered, not taken again.
    assert core.step(Report(batch(0, 1, 4))) == [Answer(0, retried=True)]
    assert core.controller.tick_of[0] == 3
    # A replaced process's report: refused, counted, not answered.
    assert core.step(Report(batch(0, 2, 5, incarnation=9))) == []
    assert core.controller.rejected["batch_stale_incarnation"] == 1
    # A batch the controller refuses gets no commands.
    assert core.step(Report({**batch(1, 1, 2), "step": "x"})) == []


def test_a_reports_flags_and_notes_go_to_the_shell() -> None:
    core = make()
    notes = [{"watcher": "rank", "duration_s": 3.0}]
    taken, answer = core.step(
        Report(batch(1, 1, 2, ending=True, collective_failed=True, outages=notes))
    )[1:]
    assert core.step(Report(batch(0, 1, 2, outages=notes)))[0] == OutageNotes(notes)
    assert isinstance(taken, Taken) and taken.ending and taken.collective_failed
    assert answer == Answer(1)


def test_an_agents_items_are_each_taken_by_their_slot() -> None:
    core = make()
    item = {**batch(0, 3, 5), "seqs": [1, 2, 3], "metrics": [step_record(0, 5)]}
    del item["seq"]
    effects = core.step(Report(item, "node-a"))
    assert [type(e) for e in effects] == [Taken, Answer]
    again = {**batch(0, 3, 5), "seqs": [2, 3]}
    assert core.step(Report(again, "node-a")) == [Answer(0, retried=True)]
    for bad in ("not an item", {"rank": 7, "seqs": [1]}, {"rank": 1, "seqs": "1"}):
        assert core.step(Report(bad, "node-a")) == []
    assert core.controller.rejected["batch_item"] == 3
    # Numbers 4-9 skipped: the agent says every number below 10 was answered (it died
    # before sending them on): no longer awaited, and said, with the lead's step records
    # that never came (ticks 6-8: its item holds every record).
    late = {**batch(0, 10, 9), "seqs": [10], "unanswered_from": 10,
            "metrics": [step_record(0, 9)]}  # fmt: skip
    assert core.step(Report(late, "node-a"))[0] == BatchesLost(0, "node-a", 6, 3)


def step_record(rank: int, tick: int) -> dict[str, Any]:
    return {"rank": rank, "step": tick, "tick": tick, "loss": 1.0, "step_time_s": 0.01}


def test_batch_numbers_given_up_are_a_loss_only_where_step_records_are_missing() -> None:
    """A restarted supervisor gets rank 1's batch 7 (ticks 20-21) after its record ended at
    batch 3: numbers 4-6 are given up, but their records reached its predecessor, so nothing is
    said. Batch 9 then skips ticks 22-23 (held records dropped while it was away): said."""
    core = make()
    first = batch(1, 3, 19, metrics=[step_record(1, 19)])
    assert BatchesLost not in map(type, core.step(Report(first)))
    resent = batch(1, 7, 21, unanswered_from=7, metrics=[step_record(1, 20), step_record(1, 21)])
    assert BatchesLost not in map(type, core.step(Report(resent)))
    dropped = batch(1, 9, 25, unanswered_from=9, metrics=[step_record(1, 24), step_record(1, 25)])
    assert core.step(Report(dropped))[0] == BatchesLost(1, None, 1, 2)
    # A new process of the rank starts wherever it adopted: no hole.
    assert core.slots.replace(1) == 2
    assert BatchesLost not in map(
        type, core.step(Report(batch(1, 1, 40, incarnation=2, metrics=[step_record(1, 40)])))
    )


def test_an_operators_stop_is_taken_once_and_the_loop_moves_the_job() -> None:
    core = make(max_targeted=3)
    core.job.state = JobState()
    core.step(GroupStarted(0))
    assert core.job.state.phase is Phase.RUNNING
    assert core.step(OperatorStop("maintenance")) == [StopAsked("maintenance")]
    assert [c["action"] for c in core.controller.commands_for(0)] == ["checkpoint_now", "abort"]
    assert core.step(OperatorStop("again")) == []  # under way already
    core.step(Pass())
    assert core.job.state.phase is Phase.ABORTING
    assert not core.ranks_ended
    core.step(RanksAllEnded())
    assert core.ranks_ended and core.record(NOW).ranks_ended == {}
