"""Lost ranks, one input at a time through the run's core: where each loss goes, what the job
does about a rank nothing replaces, and what a new supervisor takes back of it."""

from __future__ import annotations

import json

import pytest

from remedy.control.decide import Controller
from remedy.control.effects import AnomalyRecord
from remedy.control.job import (
    JobStateMachine,
    Phase,
    RanksLost,
    RestartFailed,
    Started,
)
from remedy.control.lost_ranks import (
    Dropped,
    Joined,
    NotReplaced,
    RankLost,
    RanksMoving,
    ReplacementFailed,
    ToPolicy,
)
from remedy.control.record import RunRecord
from remedy.control.run_core import RankDied, RestartMoved, RunCore
from remedy.control.sections import RestartSection
from remedy.control.slots import RankSlots
from remedy.policies import Engine, load_policy_text

POLICY = """
version: 1
name: lost-ranks-test
rules:
  - name: replace-hung
    when: {anomaly: rank_hang}
    do: [restart_rank]
  - name: tell-dead
    when: {anomaly: [rank_dead, node_lost]}
    do: [notify]
"""
NOTIFY_ONLY = """
version: 1
name: notify-only
rules:
  - name: tell
    when: {anomaly: [rank_hang, rank_dead]}
    do: [notify]
"""
AT = 5000.0  # wall time of the findings


def make(policy: str = POLICY, world: int = 4) -> RunCore:
    controller = Controller(
        Engine(load_policy_text(policy, "lost.yaml"), run_id="r"),
        world_size=world,
        group_actions=True,  # a restart is begun by the shell, and ends later
    )
    core = RunCore(
        controller,
        JobStateMachine(max_targeted=3),
        RankSlots(world, rejected=controller.rejected),
        incarnation=1,
        started=1000.0,
    )
    core.job.step(Started(0))
    for r in range(world):
        core.controller.ingest({"rank": r, "step": 7, "tick": 7}, answer=False)
    return core


def hung(rank: int, incarnation: int | None = None, at: float = AT) -> RankLost:
    return RankLost(rank, "rank_hang", f"rank {rank} made no progress", at, {"age_s": 3.0},
                    incarnation)  # fmt: skip


def test_a_loss_goes_to_the_policy_as_a_critical_supervisor_anomaly() -> None:
    core = make()
    assert core.step(hung(2)) == [ToPolicy(2, "rank_hang", "rank 2 made no progress", AT)]
    [d] = core.controller.deferred.values()  # the restart, carried out by the shell
    assert (d.action, d.ranks, d.anomaly.kind, d.anomaly.source) == (
        "restart_rank",
        (2,),
        "rank_hang",
        "supervisor",
    )
    assert d.anomaly.severity == "critical" and d.anomaly.step == 7
    assert d.anomaly.details["incarnation"] == 1 and d.anomaly.details["age_s"] == 3.0
    assert core.lost.detected_at == {2: AT}
    assert core.job.state.phase is Phase.RUNNING  # replaced: not degraded


def test_a_process_is_reported_lost_once() -> None:
    core = make()
    core.step(hung(2))
    assert core.step(hung(2)) == []
    assert core.step(RankLost(2, "rank_dead", "rank 2's process is gone", AT + 1)) == []
    assert len(core.controller.deferred) == 1


def test_evidence_about_a_replaced_process_is_dropped() -> None:
    core = make()
    core.slots.replace(1)  # incarnation 2 runs now
    assert core.step(hung(1, incarnation=1)) == [Dropped(1, "rank_hang", 1, 2)]
    assert not core.controller.deferred and not core.lost.detected_at


def test_a_rank_lost_while_a_restart_is_under_way_joins_it() -> None:
    core = make()
    core.step(hung(2))
    core.job.step(RanksLost(frozenset({2}), "rank 2 hung"))  # the shell began the restart
    effects = core.step(hung(3, at=AT + 1))
    assert effects == [
        Joined(3, "rank_hang", "rank 3 made no progress; joins the restart under way")
    ]
    assert core.job.state.phase is Phase.RECOVERING and core.job.state.lost == {2, 3}
    assert core.lost.joining == {3: "rank_hang on rank 3"}
    assert len(core.controller.deferred) == 1  # no second decision
    effects = core.controller.effects  # what its shell is yet to carry out
    [*_, recorded] = [e.record for e in effects if isinstance(e, AnomalyRecord)]
    assert recorded["rank"] == 3 and recorded["source"] == "supervisor"
    assert recorded["details"]["reason"].endswith("joins the restart under way")
    assert core.lost.take_joining() == {3: "rank_hang on rank 3"} and not core.lost.joining


def test_a_rank_lost_while_a_restart_is_only_decided_joins_it_without_moving_the_job() -> None:
    core = make()
    core.step(hung(2))  # decided, not begun: the job still runs
    [joined] = core.step(hung(0))
    assert isinstance(joined, Joined) and core.job.state.phase is Phase.RUNNING
    assert core.lost.joining == {0: "rank_hang on rank 0"}


def test_a_rank_the_restart_is_starting_failed_that_start() -> None:
    core = make()
    core.step(hung(2))
    core.job.step(RanksLost(frozenset({2}), "rank 2 hung"))
    core.slots.replace(2)  # its replacement, incarnation 2
    assert core.step(RankLost(2, "rank_dead", "gone", AT + 2)) == [ReplacementFailed(2, "gone")]


def test_during_a_full_group_restart_every_rank_it_starts_fails_that_start() -> None:
    core = make()
    core.step(hung(2))
    core.job.step(RanksLost(frozenset({2}), "rank 2 hung"))
    core.job.step(RestartFailed("no healthy rank is left", final=True))
    assert core.job.state.phase is Phase.RESTARTING_ALL
    core.lost.starting_all([0, 1, 2, 3], core.slots)
    for r in range(4):
        core.slots.replace(r)
    assert core.step(RankLost(1, "rank_dead", "gone", AT + 3)) == [ReplacementFailed(1, "gone")]
    core.lost.started_all()
    assert not core.lost.replacing(1, core.job)


@pytest.mark.parametrize(
    ("kind", "ending", "phase"),
    [("rank_hang", False, Phase.DEGRADED), ("rank_dead", True, Phase.DEGRADED)],
)
def test_a_loss_nothing_replaces_degrades_the_job_and_a_dead_rank_ends_the_run(
    kind: str, ending: bool, phase: Phase
) -> None:
    core = make(NOTIFY_ONLY)
    effects = core.step(RankLost(1, kind, "rank 1 is lost", AT))
    assert effects[0] == ToPolicy(1, kind, "rank 1 is lost", AT)
    [not_replaced] = effects[1:]
    assert isinstance(not_replaced, NotReplaced) and not_replaced.ending is ending
    assert not_replaced.why.startswith(
        "rank 1 is lost; not replaced: rule 'tell' chose notify (applied)"
    )
    assert ("the run cannot go on without it" in not_replaced.why) is ending
    assert core.job.state.phase is phase and core.job.state.lost == {1}
    assert core.job.state.reason == not_replaced.why


def test_an_unreplaced_loss_says_when_no_rule_answered_it() -> None:
    core = make(POLICY.replace("rank_dead, node_lost", "node_lost"))
    [_, not_replaced] = core.step(RankLost(0, "rank_dead", "rank 0's process is gone", AT))
    assert isinstance(not_replaced, NotReplaced)
    assert "not replaced: no rule of the policy answered it" in not_replaced.why


def test_a_dead_rank_does_not_end_a_run_the_policy_aborts_already() -> None:
    core = make(NOTIFY_ONLY)
    core.controller.abort_reason = "gpu_ecc"
    [_, not_replaced] = core.step(RankLost(3, "rank_dead", "gone", AT))
    assert isinstance(not_replaced, NotReplaced) and not not_replaced.ending


def test_a_dead_process_goes_through_the_same_path() -> None:
    core = make(NOTIFY_ONLY)
    effects = core.step(RankDied(1, 1, "rank process died: x", "rank 1's process died", AT))
    assert [type(e) for e in effects] == [ToPolicy, NotReplaced]
    assert core.results[1]["status"] == "failed"


def test_a_degraded_job_runs_again_when_its_lost_rank_moves_and_a_later_hang_is_found() -> None:
    core = make(NOTIFY_ONLY)
    core.step(hung(1))
    assert core.job.state.phase is Phase.DEGRADED
    core.step(RanksMoving(frozenset({1}), frozenset(range(4))))  # still a suspect
    assert core.job.state.phase is Phase.DEGRADED
    core.step(RanksMoving(frozenset(), frozenset({0, 2, 3})))  # no process: not back
    assert core.job.state.phase is Phase.DEGRADED
    core.step(RanksMoving(frozenset(), frozenset(range(4))))
    assert core.job.state.phase is Phase.RUNNING
    assert [type(e) for e in core.step(hung(1, at=AT + 9))] == [ToPolicy, NotReplaced]


def test_the_losses_are_taken_back_by_a_new_supervisor() -> None:
    core = make()
    core.slots.slots[2].node = "node-b"
    core.step(hung(2))
    core.job.step(RanksLost(frozenset({2}), "rank 2 hung"))
    core.step(hung(3, at=AT + 1))  # joins
    core.step(RestartMoved(RestartSection()))  # the restart's carrier, built
    record = json.loads(json.dumps(core.record(AT + 2).to_record()))
    assert record["recovery"]["detected_at"] == {"2": AT, "3": AT + 1}
    assert record["recovery"]["joining"] == {"3": "rank_hang on rank 3"}
    assert record["recovery"]["losses"]["lost_on"] == {"2": ["node-b", AT]}

    again = make()
    again.restore(RunRecord.from_record(record))
    assert again.lost.detected_at == {2: AT, 3: AT + 1}
    assert again.lost.joining == {3: "rank_hang on rank 3"}
    assert again.lost.losses.earlier("node-b", AT + 2) == {2}
    assert again.step(hung(2)) == [] and again.step(hung(3)) == []  # reported already
    assert (
        json.loads(json.dumps(again.record(AT + 2).to_record()))["recovery"] == record["recovery"]
    )


def test_the_ranks_of_a_restart_decided_before_a_crash_are_not_reported_again() -> None:
    core = make()
    core.step(hung(2))
    record = core.record(AT).to_record()
    record["recovery"]["losses"]["reported"] = []  # a record older than the losses' part
    again = make()
    again.restore(RunRecord.from_record(json.loads(json.dumps(record))))
    # The deferred restart takes rank 2 in: its death on adoption is not a new loss.
    assert again.step(RankLost(2, "rank_dead", "gone on adoption", AT + 5)) == []


def test_nothing_lost_and_no_restart_writes_no_recovery_section() -> None:
    assert make().record(AT).recovery is None


def test_a_hang_records_the_step_the_ping_found_the_group_at_not_the_last_report() -> None:
    """The ranks last reported step 7; the ping that found rank 2 hung had its peers waiting
    in step 12 (`control.stuck_at`): the decision records step 12; a pinged step older than
    the reports does not move it back."""
    core = make()
    core.step(RankLost(2, "rank_hang", "rank 2 made no progress", AT,
                       {"age_s": 3.0, "step": 12, "tick": 12}))  # fmt: skip
    [d] = core.controller.deferred.values()
    assert (d.anomaly.step, d.anomaly.tick) == (12, 12)
    older = make()
    older.step(RankLost(2, "rank_hang", "stuck", AT, {"step": 3, "tick": 3}))
    [d] = older.controller.deferred.values()
    assert d.anomaly.step == 7
