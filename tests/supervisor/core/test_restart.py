"""The restart machine, without Ray: one transition at a time, then whole restarts with a
supervisor crash after every effect, resumed from the state it had written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from remedy.control import restart
from remedy.control.job import (
    JobState,
    Phase,
    RanksLost,
    Regrouped,
    RestartFailed,
    transition,
)
from remedy.control.restart import (
    AllFailed,
    AllRestarted,
    AttemptFailed,
    AwaitSteps,
    Backoff,
    Begin,
    Checked,
    CheckFormed,
    CheckSurvivors,
    Formed,
    Job,
    Kill,
    KillAll,
    Launch,
    Launched,
    Resolve,
    RestartAll,
    RestartState,
    Resume,
    Stage,
    Stepped,
    Waited,
)

WORLD = 4
RUNNING = JobState(Phase.RUNNING, 0)
INFO = {"generation": 1, "source": 0, "replacements": {"3": "warm spare"}}


def _run(
    state: RestartState, job: JobState, inp: restart.RestartInput, k: int = 3
) -> tuple[RestartState, JobState, list[restart.Effect]]:
    """One step, and the job as its `Job` effects leave it (the shell applies them in order)."""
    state, effects = restart.step(state, job, inp, cause="rank_hang", max_targeted=k)
    for e in effects:
        if isinstance(e, Job):
            job, _ = transition(job, e.input, max_targeted=k)
    return state, job, effects


def _acts(effects: list[restart.Effect]) -> list[restart.Effect]:
    return [e for e in effects if not isinstance(e, Job)]


# ------------------------------------------------------------ one at a time
def test_a_restart_kills_checks_launches_and_waits_for_a_step() -> None:
    st, job, fx = _run(RestartState("d1", WORLD), RUNNING, Begin((3,), "rank_hang on rank 3"))
    assert fx == [Job(RanksLost(frozenset({3}), "rank_hang on rank 3")), Kill((3,), (0, 1, 2))]
    assert job.phase is Phase.RECOVERING and st.stage is Stage.KILL
    st, job, fx = _run(st, job, restart.Killed(front=19))
    assert fx == [CheckSurvivors((0, 1, 2))] and st.front == 19
    st, job, fx = _run(st, job, Checked())
    assert fx == [Launch((3,), 0)]
    st, job, fx = _run(st, job, Launched(INFO))
    assert fx == [AwaitSteps(19, (3,), (0, 1, 2))]
    assert st.launched == {**INFO, "blocked": []} and st.stage is Stage.STEP
    st, job, fx = _run(st, job, Stepped())
    assert fx[0] == Job(Regrouped(1))
    [resolve] = _acts(fx)
    assert isinstance(resolve, Resolve) and resolve.outcome == "applied"
    assert (
        resolve.detail == "replaced rank 3 by a warm spare; generation 1 formed from rank 0's state"
    )
    assert job == JobState(Phase.RUNNING, 1) and st.stage is Stage.DONE


def test_blocked_survivors_and_ranks_lost_meanwhile_are_replaced_too() -> None:
    st, job, _ = _run(RestartState("d1", WORLD), RUNNING, Begin((3,), "hang"))
    st, job, _ = _run(st, job, restart.Killed(5))
    st, job, fx = _run(st, job, Checked(blocked=(1,), joined=(2,)))
    assert fx == [
        Job(RanksLost(frozenset({1}), restart.STILL_BLOCKED)),
        Launch((1, 2, 3), 0),
    ]
    assert job.lost == {1, 3} and st.blocked == (1,)
    st, job, _ = _run(st, job, Launched(INFO))
    assert st.launched is not None and st.launched["blocked"] == [1]


def test_no_survivor_left_restarts_the_whole_group_at_once() -> None:
    """Every survivor still blocked: no rank can give the state, so no targeted attempt can
    work; the whole group restarts from the last checkpoint without a back-off."""
    st, job, _ = _run(RestartState("d1", WORLD), RUNNING, Begin((3,), "hang"))
    st, job, _ = _run(st, job, restart.Killed(5))
    st, job, fx = _run(st, job, Checked(blocked=(0, 1, 2)))
    assert Job(RestartFailed(restart.NONE_RECOVERED, final=True)) in fx
    assert _acts(fx) == [RestartAll("rank_hang")] and job.phase is Phase.RESTARTING_ALL
    assert job.attempts == 1 and st.why == f"targeted restart failed: {restart.NONE_RECOVERED}"


def test_survivors_under_a_frameworks_loop_restart_the_whole_group_and_say_why() -> None:
    """Survivors in Lightning's or Hugging Face's loop never re-form the group: each is lost
    for that reason, and with none left the whole group restarts, saying so (not that the
    survivors failed to recover)."""
    st, job, _ = _run(RestartState("d1", WORLD), RUNNING, Begin((3,), "dead"))
    st, job, _ = _run(st, job, restart.Killed(5))
    st, job, fx = _run(st, job, Checked(framework=(0, 1, 2)))
    assert Job(RanksLost(frozenset({0, 1, 2}), restart.FRAMEWORK_LOOP)) in fx
    assert Job(RestartFailed(restart.NONE_CAN_REGROUP, final=True)) in fx
    assert _acts(fx) == [RestartAll("rank_hang")] and job.phase is Phase.RESTARTING_ALL
    assert st.why == f"no targeted restart: {restart.NONE_CAN_REGROUP}"


def test_every_rank_lost_restarts_the_whole_group_at_once() -> None:
    """A node that held every rank: the decision's ranks are the whole world."""
    st, job, fx = _run(RestartState("d1", WORLD), RUNNING, Begin((0, 1, 2, 3), "node lost"))
    assert Job(RestartFailed(restart.NO_SOURCE, final=True)) in fx
    assert _acts(fx) == [RestartAll("rank_hang")] and job.phase is Phase.RESTARTING_ALL
    assert st.stage is Stage.ALL


def test_a_failed_attempt_launches_again_after_a_pause_and_a_second_check() -> None:
    st, job, _ = _run(RestartState("d1", WORLD), RUNNING, Begin((3,), "hang"))
    for inp in (restart.Killed(5), Checked(), Launched(INFO)):
        st, job, _ = _run(st, job, inp)
    st, job, fx = _run(st, job, AttemptFailed("rank 3: its actor died"))
    assert _acts(fx) == [Backoff(1)] and not st.first
    # Its replacement is killed and the survivors checked again, the failed generation
    # abandoned first; the tick to pass stays the one from before the loss.
    st, job, fx = _run(st, job, Waited())
    assert fx == [Kill((3,), (0, 1, 2))]
    st, job, fx = _run(st, job, restart.Killed(front=30))
    assert fx == [CheckSurvivors((0, 1, 2), retry=True)] and st.front == 5
    st, job, fx = _run(st, job, Checked())
    assert fx == [Launch((3,), 0, retry=True)]
    st, job, fx = _run(st, job, Launched({**INFO, "replacements": {"3": "new actor"}}))
    assert fx == [AwaitSteps(5, (3,), (0, 1, 2))]
    assert st.launched is not None and "blocked" not in st.launched  # a relaunch's own info


def test_a_survivor_stuck_in_a_failed_generations_rendezvous_is_replaced_too() -> None:
    """gloo waits for good for a peer that died in its rendezvous: a survivor still joining
    when the next attempt checks would never take its order (`workers.phases.JOINING`)."""
    st, job, _ = _run(RestartState("d1", WORLD), RUNNING, Begin((3,), "hang"))
    for inp in (restart.Killed(5), Checked(), Launched(INFO), AttemptFailed("x"), Waited()):
        st, job, _ = _run(st, job, inp)
    st, job, _ = _run(st, job, restart.Killed(8))
    st, job, fx = _run(st, job, Checked(stuck=(1,)))
    assert fx == [
        Job(RanksLost(frozenset({1}), restart.STUCK_JOINING)),
        Launch((1, 3), 0, retry=True),
    ]
    assert job.lost == {1, 3} and job.reason == restart.STUCK_JOINING
    st, job, _ = _run(st, job, Launched(INFO))
    assert st.launched is not None and st.launched["blocked"] == [1]
    # After a supervisor crash: a survivor still joining the crashed one's launch.
    recovering = JobState(Phase.RECOVERING, 0, frozenset({3}), "hang")
    launched = RestartState("d1", WORLD, Stage.STEP, (3,), front=7, launched=INFO)
    st, job, _ = _run(launched, recovering, Resume((3,), "hang"))
    st, job, fx = _run(st, job, Formed(False))
    assert fx == [Kill((3,), (0, 1, 2))]
    st, job, fx = _run(st, job, restart.Killed(9))
    assert fx == [CheckSurvivors((0, 1, 2))]
    st, job, fx = _run(st, job, Checked(blocked=(0,), stuck=(2,)))
    assert fx == [
        Job(RanksLost(frozenset({0}), restart.STILL_BLOCKED)),
        Job(RanksLost(frozenset({2}), restart.STUCK_JOINING)),
        Launch((0, 2, 3), 1),
    ]


def test_a_rank_lost_during_the_pause_makes_the_next_attempt_start_over() -> None:
    st, job, _ = _run(RestartState("d1", WORLD), RUNNING, Begin((3,), "hang"))
    st, job, _ = _run(st, job, restart.Killed(5))
    st, job, _ = _run(st, job, AttemptFailed("x"))
    st, job, fx = _run(st, job, Waited(joined=(1,)))
    assert fx == [Kill((1, 3), (0, 2))] and st.first
    st, job, fx = _run(st, job, restart.Killed(6))
    assert fx == [CheckSurvivors((0, 2))] and st.front == 6


def test_attempts_run_out_then_the_whole_group_restarts_then_the_run_ends() -> None:
    st, job, _ = _run(RestartState("d1", WORLD), RUNNING, Begin((3,), "hang"), k=2)
    st, job, fx = _run(st, job, AttemptFailed("one"), k=2)
    assert _acts(fx) == [Backoff(1)]
    st, job, _ = _run(st, job, Waited(), k=2)
    st, job, fx = _run(st, job, AttemptFailed("two"), k=2)
    assert _acts(fx) == [RestartAll("rank_hang")] and job.phase is Phase.RESTARTING_ALL
    st, job, fx = _run(st, job, AllFailed("no rank stepped"), k=2)
    assert _acts(fx) == [
        KillAll(),
        Resolve(
            "failed",
            "targeted restart failed: two; full-group restart failed: no rank stepped",
            (3,),
        ),
    ]
    assert job.phase is Phase.ABORTING


def test_with_targeted_restarts_off_the_whole_group_restarts_at_once() -> None:
    st, job, fx = _run(RestartState("d1", WORLD), RUNNING, Begin((3,), "hang"), k=0)
    assert _acts(fx) == [RestartAll("rank_hang")]
    info = {"generation": 1, "resumed": "from checkpoint step 10"}
    st, job, fx = _run(st, job, AllRestarted(info), k=0)
    assert fx[0] == Job(Regrouped(1, "from checkpoint step 10"))
    assert _acts(fx) == [
        Resolve(
            "applied",
            f"{restart.TARGETED_OFF}; restarted every rank in generation 1 from checkpoint step 10",
            (3,),
            info,
        )
    ]


def test_the_wait_for_a_step_has_the_launchs_deadline_which_a_resume_keeps() -> None:
    """The group must step within REGROUP_TIMEOUT_S of the launch; the deadline is in the state
    record, so a supervisor restarted while the group re-forms waits out the rest of it, not a
    whole new one. A record from before the deadline was kept has none (a fresh wait)."""
    checked = RestartState("d1", WORLD, Stage.LAUNCH, (3,), front=7)
    recovering = JobState(Phase.RECOVERING, 0, frozenset({3}), "hang")
    st, job, fx = _run(checked, recovering, Launched(INFO, at=1000.0))
    deadline = 1000.0 + restart.REGROUP_TIMEOUT_S
    assert fx == [AwaitSteps(7, (3,), (0, 1, 2), deadline=deadline)] and st.deadline == deadline
    back = RestartState.from_dict(json.loads(json.dumps(st.to_dict())))
    st, job, fx = _run(back, job, Resume((3,), "hang"))
    assert fx == [CheckFormed(1)]
    _, _, fx = _run(st, job, Formed(True))
    assert fx == [AwaitSteps(7, (3,), (0, 1, 2), fresh=True, deadline=deadline)]
    old = {k: v for k, v in st.to_dict().items() if k != "deadline"}
    assert RestartState.from_dict(old).deadline == 0.0


def test_a_run_stopped_from_outside_ends_the_restart_with_why() -> None:
    st, job, _ = _run(RestartState("d1", WORLD), RUNNING, Begin((3,), "hang"))
    job = JobState(Phase.ABORTING, 0, reason="operator stop")
    st, job, fx = _run(st, job, restart.Killed(5))
    assert _acts(fx) == [
        Resolve("failed", "not carried on: the job is aborting (operator stop)", (3,))
    ]
    assert st.stage is Stage.DONE and _run(st, job, Stepped())[2] == []  # over is over
    # Decided while the job is ending: nothing is started, and no rank is killed.
    _, _, fx = _run(RestartState("d2", WORLD), job, Begin((2,), "hang"))
    assert fx == [Resolve("failed", "not carried on: the job is aborting (operator stop)", (2,))]


def test_resume_checks_the_crashed_supervisors_launch_before_anything_else() -> None:
    recovering = JobState(Phase.RECOVERING, 0, frozenset({3}), "hang")
    launched = RestartState("d1", WORLD, Stage.STEP, (3,), front=7, launched=INFO)
    st, job, fx = _run(launched, recovering, Resume((3,), "hang"))
    assert fx == [CheckFormed(1)]
    _, _, fx = _run(st, job, Formed(True))
    assert fx == [AwaitSteps(7, (3,), (0, 1, 2), fresh=True)]
    _, _, fx = _run(st, job, Formed(False))
    assert fx == [Kill((3,), (0, 1, 2))]
    # Resumed anywhere else: the attempt starts over from killing, with every lost rank.
    checking = RestartState("d1", WORLD, Stage.CHECK, (3,), first=False)
    _, _, fx = _run(
        checking, JobState(Phase.RECOVERING, 0, frozenset({2, 3}), "x"), Resume((3,), "")
    )
    assert fx == [Kill((2, 3), (0, 1))]
    # Decided but never begun: it begins.
    _, job, fx = _run(RestartState("d1", WORLD), RUNNING, Resume((3,), "hang"))
    assert _acts(fx) == [Kill((3,), (0, 1, 2))] and job.phase is Phase.RECOVERING
    # Resumed while the job is ending: resolved, no rank killed.
    _, _, fx = _run(launched, JobState(Phase.ABORTING, 0, reason="stop"), Resume((3,), ""))
    assert fx == [Resolve("failed", "not carried on: the job is aborting (stop)", (3,))]
    # Resumed after it had ended, before its decision was resolved: the same end again.
    ended = RestartState(
        "d1", WORLD, Stage.DONE, (3,), end=(KillAll(), Resolve("failed", "x", (3,)))
    )
    _, _, fx = _run(ended, JobState(Phase.ABORTING, 0, reason="x"), Resume((3,), ""))
    assert fx == [KillAll(), Resolve("failed", "x", (3,))]


def test_the_state_round_trips_and_refuses_another_schema() -> None:
    st = RestartState("d1", WORLD, Stage.STEP, (1, 3), False, 9, (1,), INFO, "why")
    assert RestartState.from_dict(json.loads(json.dumps(st.to_dict()))) == st
    with pytest.raises(ValueError, match="schema"):
        RestartState.from_dict({**st.to_dict(), "schema": 99})


# ------------------------------------------ crash after every effect, resume
@dataclass
class World:
    """The ranks' processes, which outlive a supervisor crash: generation and incarnation."""

    generation: int = 0
    procs: dict[int, tuple[int, int] | None] = field(
        default_factory=lambda: dict.fromkeys(range(WORLD), (0, 1))
    )
    fail_launches: int = 0  # launches whose replacements die before stepping
    fail_all: bool = False
    blocked: tuple[int, ...] = ()  # survivors that stay in the broken collective
    # Survivors a failed launch leaves in its rendezvous for good: they take no order after.
    stuck_on_fail: tuple[int, ...] = ()
    stuck: set[int] = field(default_factory=set)
    resolved: list[Resolve] = field(default_factory=list)
    effects: int = 0

    def carry(self, effect: restart.Effect) -> restart.RestartInput | None:
        self.effects += 1
        match effect:
            case Kill(ranks, _):
                for r in ranks:
                    self.procs[r] = None
                return restart.Killed(front=10)
            case CheckSurvivors(live):
                blocked = tuple(r for r in self.blocked if r in live)
                stuck = tuple(sorted(r for r in self.stuck if r in live))
                for r in (*blocked, *stuck):
                    self.procs[r] = None
                self.blocked, self.stuck = (), set()
                return Checked(blocked=blocked, stuck=stuck)
            case Launch(ranks, _source, _retry):
                self.generation += 1  # a retry too: the failed generation is abandoned
                for r in ranks:
                    old = self.procs[r]
                    self.procs[r] = (self.generation, (old[1] if old else 0) + 1)
                for r, p in self.procs.items():
                    if p is not None and r not in ranks and r not in self.stuck:
                        self.procs[r] = (self.generation, p[1])
                dead = self.fail_launches > 0
                self.fail_launches -= 1
                if dead:
                    self.procs[ranks[0]] = None
                    self.stuck |= {r for r in self.stuck_on_fail if r not in ranks}
                return Launched({"generation": self.generation, "source": _source,
                                 "replacements": {str(r): "new actor" for r in ranks}})  # fmt: skip
            case AwaitSteps():
                ok = all(p is not None and p[0] == self.generation for p in self.procs.values())
                return Stepped() if ok else AttemptFailed("a replacement died")
            case CheckFormed(generation):
                return Formed(
                    all(p is not None and p[0] == generation for p in self.procs.values())
                )
            case Backoff():
                return Waited()
            case RestartAll():
                if self.fail_all:
                    return AllFailed("no checkpoint loads")
                self.generation += 1
                self.procs = dict.fromkeys(range(WORLD), (self.generation, 9))
                return AllRestarted({"generation": self.generation, "resumed": "from step 0"})
            case KillAll():
                self.procs = dict.fromkeys(range(WORLD))
                return None
            case Resolve():
                self.resolved.append(effect)
                return None
        raise AssertionError(effect)


def _supervise(
    world: World, k: int, crash_after: int | None
) -> tuple[JobState, RestartState, bool]:
    """Run restart d1 of rank 3 to its end; the supervisor dies right after carrying out
    effect number `crash_after` and a new one resumes from the last state it had written."""
    written: tuple[dict[str, Any], dict[str, Any]] | None = None  # (machine, job) as JSON
    st, job = RestartState("d1", WORLD), RUNNING
    inp: restart.RestartInput = Begin((3,), "rank_hang on rank 3")
    crashed = False
    for _ in range(200):
        st, job, effects = _run(st, job, inp, k)
        written = (st.to_dict(), job.to_dict())  # the state record, before the effects
        answer = None
        for effect in _acts(effects):
            answer = world.carry(effect)
            if crash_after is not None and not crashed and world.effects == crash_after:
                crashed = True
                break
        else:
            if answer is None:
                return job, st, crashed
            inp = answer
            continue
        if world.resolved:  # the decision is resolved (journaled): nothing is left to resume
            return job, st, crashed
        # Crashed: a new supervisor reads the state record back and resumes.
        st = RestartState.from_dict(json.loads(json.dumps(written[0])))
        job = JobState.from_dict(json.loads(json.dumps(written[1])))
        inp = Resume((3,), "rank_hang on rank 3")
    raise AssertionError("the restart never ended")


# (name, world, max targeted attempts, outcome, the job's end phase)
FLOWS = [
    ("targeted", lambda: World(), 3, "applied", Phase.RUNNING),
    ("blocked survivor", lambda: World(blocked=(1,)), 3, "applied", Phase.RUNNING),
    ("relaunched once", lambda: World(fail_launches=1), 3, "applied", Phase.RUNNING),
    (
        "survivor stuck in a failed rendezvous",
        lambda: World(fail_launches=1, stuck_on_fail=(2,)),
        3,
        "applied",
        Phase.RUNNING,
    ),
    ("full-group after failures", lambda: World(fail_launches=9), 2, "applied", Phase.RUNNING),
    ("full-group only", lambda: World(), 0, "applied", Phase.RUNNING),
    (
        "full-group fails",
        lambda: World(fail_launches=9, fail_all=True),
        2,
        "failed",
        Phase.ABORTING,
    ),
]


@pytest.mark.parametrize(
    ("name", "make", "k", "outcome", "phase"), FLOWS, ids=[f[0] for f in FLOWS]
)
def test_a_supervisor_killed_after_any_effect_resumes_the_restart_to_the_same_end(
    name: str, make: Any, k: int, outcome: str, phase: Phase
) -> None:
    """Every crash point of every flow: the restart ends once, as without a crash, and every
    rank runs in one generation (or, when it failed, none runs)."""
    clean = make()
    job, _, _ = _supervise(clean, k, None)
    assert [r.outcome for r in clean.resolved] == [outcome] and job.phase is phase
    targeted = k > 0 and "full-group" not in name
    if outcome == "applied":  # a targeted flow ends targeted, not by a full-group restart
        assert clean.resolved[0].detail.startswith("replaced") == targeted
    for crash_after in range(1, clean.effects + 1):
        world = make()
        job, st, crashed = _supervise(world, k, crash_after)
        where = f"{name}, crash after effect {crash_after}"
        assert crashed, where
        assert [r.outcome for r in world.resolved] == [outcome], where
        assert job.phase is phase and st.stage is Stage.DONE, where
        alive = [p for p in world.procs.values() if p is not None]
        if outcome == "applied":
            assert len(alive) == WORLD and {g for g, _ in alive} == {world.generation}, where
            assert job.generation == world.generation, where
        else:
            assert not alive, where
