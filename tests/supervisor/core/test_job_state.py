"""The job state machine walks one transition at a time, journals each with a reason, and refuses nonsense."""

from __future__ import annotations

from typing import Any

import pytest

from remedy.control.job import (
    AbortRequested,
    JobState,
    JobStateMachine,
    Phase,
    RanksBack,
    RanksEnded,
    RanksLost,
    RanksUnreplaced,
    Regrouped,
    RestartFailed,
    Started,
    TransitionError,
    transition,
)


def _machine(max_targeted: int = 3) -> tuple[JobStateMachine, list[dict[str, Any]]]:
    machine = JobStateMachine(max_targeted=max_targeted)
    return machine, machine.moves


def test_targeted_restart_cycle_is_journaled() -> None:
    """starting -> running(0) -> recovering(0, {3}) -> running(1) -> finished, each step journaled."""
    m, journal = _machine()
    assert m.step(Started(0))[1] == JobState(Phase.RUNNING, 0)
    prev, nxt = m.step(RanksLost(frozenset({3}), "rank_hang on rank 3"))
    assert prev.phase is Phase.RUNNING
    assert nxt.phase is Phase.RECOVERING and nxt.lost == {3} and nxt.generation == 0
    assert m.step(Regrouped(1))[1] == JobState(Phase.RUNNING, 1)
    assert m.step(RanksEnded("completed"))[1].phase is Phase.FINISHED
    assert [r["to"]["phase"] for r in journal] == ["running", "recovering", "running", "finished"]
    assert "replacing only rank 3 of generation 0" in journal[1]["reason"]
    assert "formed generation 1" in journal[2]["reason"]


def test_failed_restarts_escalate_to_full_restart_then_abort() -> None:
    """K failed targeted restarts -> restarting-all; a failed full restart -> aborting -> aborted."""
    m, journal = _machine(max_targeted=2)
    m.step(Started(0))
    m.step(RanksLost(frozenset({1}), "rank_dead on rank 1"))
    assert m.step(RestartFailed("spare died"))[1].phase is Phase.RECOVERING
    assert m.step(RestartFailed("spare died"))[1].phase is Phase.RESTARTING_ALL
    assert m.step(RestartFailed("no checkpoint"))[1].phase is Phase.ABORTING
    assert m.step(RanksEnded("failed"))[1].phase is Phase.ABORTED
    reasons = [r["reason"] for r in journal]
    assert "trying again" in reasons[2]
    assert "restarting the whole group" in reasons[3]
    assert "aborting the run" in reasons[4]


def test_full_restart_that_works_returns_to_running() -> None:
    """restarting-all -> running(g+1), the reason naming the checkpoint resumed from."""
    m, journal = _machine(max_targeted=1)
    m.step(Started(0))
    m.step(RanksLost(frozenset({2}), "rank_dead on rank 2"))
    assert m.step(RestartFailed("replacement raised"))[1].phase is Phase.RESTARTING_ALL
    assert m.step(Regrouped(2, "from checkpoint step 30"))[1] == JobState(Phase.RUNNING, 2)
    assert journal[-1]["reason"] == (
        "full-group restart after losing rank 2 formed generation 2 "
        "(from checkpoint step 30); training"
    )


def test_no_targeted_restarts_goes_straight_to_full_restart() -> None:
    """With max_targeted_restarts 0 a lost rank moves running -> restarting-all at once."""
    m, journal = _machine(max_targeted=0)
    m.step(Started(0))
    assert m.step(RanksLost(frozenset({3}), "rank_hang on rank 3"))[1].phase is (
        Phase.RESTARTING_ALL
    )
    assert "targeted restarts are off" in journal[-1]["reason"]


def test_a_second_loss_during_recovery_widens_the_lost_set() -> None:
    """A rank lost while another is being replaced joins the same recovery."""
    m, _ = _machine()
    m.step(Started(0))
    m.step(RanksLost(frozenset({3}), "hang"))
    assert m.step(RanksLost(frozenset({1}), "blocked"))[1].lost == {1, 3}


@pytest.mark.parametrize(
    ("state", "inp"),
    [
        (JobState(Phase.RUNNING), Started(0)),
        (JobState(Phase.RUNNING), Regrouped(1)),
        (JobState(Phase.RUNNING), RestartFailed("x")),
        (JobState(Phase.FINISHED), RanksLost(frozenset({0}), "x")),
        (JobState(Phase.STARTING), RanksLost(frozenset({0}), "x")),
        (JobState(Phase.RECOVERING), RanksUnreplaced(frozenset({0}), "x")),
        (JobState(Phase.RUNNING), RanksBack(frozenset({0}))),
    ],
)
def test_inputs_that_make_no_sense_are_refused(state: JobState, inp: Any) -> None:
    """An input impossible in the current phase raises TransitionError (a supervisor bug, not a job fault)."""
    with pytest.raises(TransitionError):
        transition(state, inp)


def test_abort_and_end_states() -> None:
    """An abort request ends aborted; a run that ends while recovering has failed."""
    assert transition(JobState(Phase.RUNNING), AbortRequested("policy"))[0].phase is Phase.ABORTING
    recovering = JobState(Phase.RECOVERING, 0, frozenset({2}))
    assert transition(recovering, RanksEnded("completed"))[0].phase is Phase.FAILED


def test_state_round_trips_through_its_record() -> None:
    """A journaled state record rebuilds the same state."""
    state = JobState(Phase.RECOVERING, 4, frozenset({1, 3}), "hang", 2)
    assert JobState.from_dict(state.to_dict()) == state


def test_a_lost_rank_nothing_replaces_degrades_the_job() -> None:
    """running -> degraded(lost {2}) says why; the job ends failed for that reason, not completed."""
    m, journal = _machine()
    m.step(Started(0))
    _, nxt = m.step(RanksUnreplaced(frozenset({2}), "rank 2 hung; not replaced: notify (applied)"))
    assert nxt.phase is Phase.DEGRADED and nxt.lost == {2}
    assert "the job is degraded" in journal[-1]["reason"]
    assert "not replaced: notify" in journal[-1]["reason"]
    assert m.step(RanksEnded("failed", nxt.reason))[1].phase is Phase.FAILED
    assert journal[-1]["reason"] == nxt.reason


def test_a_degraded_job_runs_again_when_its_lost_ranks_come_back() -> None:
    """degraded(lost {1, 3}) -> degraded(lost {3}) -> running, the generation kept."""
    m, _ = _machine()
    m.step(Started(0))
    m.step(RanksUnreplaced(frozenset({1}), "slow"))
    assert m.step(RanksUnreplaced(frozenset({3}), "slow"))[1].lost == {1, 3}
    assert m.step(RanksBack(frozenset({1})))[1] == JobState(
        Phase.DEGRADED, 0, frozenset({3}), "slow"
    )
    assert m.step(RanksBack(frozenset({3})))[1] == JobState(Phase.RUNNING, 0)


def test_a_restart_of_a_degraded_job_recovers_the_ranks_it_replaces() -> None:
    """degraded(lost {1}) -> a later restart_rank of rank 2 -> recovering(lost {2})."""
    state = JobState(Phase.DEGRADED, 0, frozenset({1}), "slow")
    nxt, _ = transition(state, RanksLost(frozenset({2}), "rank_dead on rank 2"))
    assert (nxt.phase, nxt.lost) == (Phase.RECOVERING, frozenset({2}))
