"""The hang watch suspects stalled ranks against adaptive timeouts and names the hung one from pings."""

from __future__ import annotations

import pytest

from remedy.control.hang_watch import DEAD, NO_ANSWER, HangWatch, HangWatchConfig
from remedy.protocol import phases

CFG = HangWatchConfig(floor_s=0.75, step_multiple=10.0, startup_s=60.0,
                      first_steps=3, first_step_s=20.0, behind_s=5.0)  # fmt: skip


def _running(
    watch: HangWatch, rank: int, *, step_s: float, ticks: int = 10, t0: float = 0.0
) -> float:
    watch.started(rank, t0)
    now = t0
    for tick in range(ticks):
        now += step_s
        watch.beat(rank, tick, now, [step_s])
    return now


def test_timeout_has_a_floor_and_follows_step_times() -> None:
    """Fast steps get the floor; slow steps get 10 x p99."""
    watch = HangWatch(CFG)
    _running(watch, 0, step_s=0.01)
    _running(watch, 1, step_s=0.2)
    assert watch.timeout(0) == pytest.approx(0.75)
    assert watch.timeout(1) == pytest.approx(2.0)


def test_start_up_and_first_steps_get_longer_allowances() -> None:
    """Before its first step a rank gets startup_s; during its first steps first_step_s."""
    watch = HangWatch(CFG)
    watch.started(0, 0.0)
    assert watch.timeout(0) == 60.0
    watch.beat(0, 0, 1.0, [0.01])
    assert watch.timeout(0) == 20.0
    assert watch.suspects(15.0) == []
    assert watch.suspects(22.0) == [0]


def test_a_stalled_rank_is_suspected_only_after_its_timeout() -> None:
    """A rank quiet for longer than its timeout is suspect; an allowance defers it."""
    watch = HangWatch(CFG)
    now = _running(watch, 0, step_s=0.01)
    assert watch.suspects(now + 0.7) == []
    assert watch.suspects(now + 0.8) == [0]
    watch.allow(0, 5.0, now + 0.8)
    assert watch.suspects(now + 3.0) == []


def test_judge_names_the_silent_rank_not_its_blocked_peers() -> None:
    """Ranks blocked in the collective answer pings; the one that does not is hung."""
    watch = HangWatch(CFG)
    pings = {0: {"tick": 20, "phase": "step"}, 1: {"tick": 20, "phase": "step"}, 2: NO_ANSWER}
    verdict = watch.judge(pings)
    assert verdict.hung == [2] and verdict.dead == []
    assert "did not answer" in verdict.reason


def test_judge_names_dead_ranks_and_laggards() -> None:
    """A gone actor is dead; with every rank answering, the one behind the others is hung."""
    watch = HangWatch(CFG)
    assert watch.judge({0: {"tick": 3}, 1: DEAD}).dead == [1]
    laggard = watch.judge({0: {"tick": 5, "phase": "step"}, 1: {"tick": 4, "phase": "step"}})
    assert laggard.hung == [1]
    assert watch.judge({0: {"tick": 5}, 1: {"tick": 5}}).hung == []
    # A rank one tick behind that is not stalled merely raced its report.
    racing = {0: {"tick": 11}, 1: {"tick": 10}}
    assert watch.judge(racing, suspects=[0]).hung == []
    assert watch.judge({0: NO_ANSWER, 1: {"tick": 3}}, suspects=[1]).hung == []
    # Nobody answered: a stalled node, not a hung rank.
    assert watch.judge({0: NO_ANSWER, 1: NO_ANSWER}).hung == []


def test_a_rank_behind_but_answering_is_hung_only_after_behind_s() -> None:
    """Slow is not stuck: a laggard that answers pings is named only once stalled for behind_s."""
    watch = HangWatch(CFG)
    now = _running(watch, 0, step_s=0.01, ticks=12)
    _running(watch, 1, step_s=0.01, ticks=11)
    pings = {0: {"tick": 11, "phase": "step"}, 1: {"tick": 10, "phase": "boundary"}}
    stalled = now + 1.0
    assert watch.judge(pings, watch.suspects(stalled), now=stalled).hung == []
    late = now + 5.5
    assert watch.judge(pings, watch.suspects(late), now=late).hung == [1]


def test_ranks_quiet_together_and_one_a_moment_late_is_not_hung() -> None:
    """Every rank spends 8 s outside the Guard's steps (a plain stretch, an undeclared eval);
    ranks 1-2 come back a moment before rank 0: rank 0 is behind for that moment, not for
    the 8 s, and is named only once it stays behind for behind_s."""
    watch = HangWatch(CFG)
    now = 0.0
    for rank in range(3):
        now = _running(watch, rank, step_s=0.01, ticks=11)
    back = now + 8.0
    watch.beat(1, 11, back)
    watch.beat(2, 11, back)
    pings = {0: {"tick": 10, "phase": "boundary"}, 1: {"tick": 11, "phase": "step"},
             2: {"tick": 11, "phase": "step"}}  # fmt: skip
    moment = back + 0.05
    assert watch.age(0, moment) > CFG.behind_s  # quiet for longer than behind_s ...
    assert watch.judge(pings, watch.suspects(moment), now=moment).hung == []  # ... not behind
    stuck = back + CFG.behind_s + 0.5
    assert watch.judge(pings, watch.suspects(stuck), now=stuck).hung == [0]


def test_progress_seen_in_a_ping_ends_suspicion() -> None:
    """A rank quiet between reports but answering a ping from a later tick is not suspect."""
    watch = HangWatch(CFG)
    now = _running(watch, 0, step_s=0.01)
    assert watch.suspects(now + 0.8) == [0]
    watch.beat(0, 30, now + 0.8)
    assert watch.suspects(now + 0.9) == []


def test_slow_first_steps_do_not_set_the_timeout() -> None:
    """The first steps' times (DDP warm-up) stay out of the p99 that sets the timeout."""
    watch = HangWatch(CFG)
    watch.started(0, 0.0)
    watch.beat(0, 0, 0.1)
    watch.beat(0, 3, 9.0, [5.0, 2.0, 1.0])
    now = 9.0
    for tick in range(4, 20):
        now += 0.01
        watch.beat(0, tick, now, [0.01])
    assert watch.timeout(0) == pytest.approx(0.75)


def test_an_allowance_ends_when_settled() -> None:
    """After a restart the survivors' regroup allowance ends, so a second hang is found as fast."""
    watch = HangWatch(CFG)
    now = _running(watch, 0, step_s=0.01)
    watch.allow(0, 120.0, now)
    assert watch.suspects(now + 1.0) == []
    watch.settle(0)
    assert watch.suspects(now + 1.0) == [0]


def test_an_alarm_makes_every_rank_that_has_not_moved_since_a_suspect() -> None:
    """A rank's failed collective: its peers are suspects at once, far inside their timeout,
    until a ping round started after the alarm is judged; a rank that moves since is not."""
    watch = HangWatch(CFG)
    now = max(_running(watch, r, step_s=0.01) for r in range(3))
    assert watch.suspects(now + 0.05) == []
    watch.alarm(now + 0.05)
    watch.beat(2, 10, now + 0.06, [0.01])  # moved after the alarm
    assert watch.suspects(now + 0.07) == [0, 1]
    assert watch.alarmed(0, now + 0.07) and not watch.alarmed(2, now + 0.07)
    watch.alarm(now + 0.08)  # a second survivor's report: the same alarm
    assert watch.alarmed_at == now + 0.05
    watch.clear_alarm(now + 0.04)  # a round started before it does not end it
    assert watch.suspects(now + 0.09) == [0, 1]
    watch.clear_alarm(now + 0.07)
    assert watch.alarmed_at is None and watch.suspects(now + 0.1) == []


def test_an_alarm_round_names_only_the_rank_that_does_not_answer() -> None:
    """Survivors waiting for an order answer the ping; the gone peer is named, within its
    timeout, and an allowance (a rank adopting state) still holds."""
    watch = HangWatch(CFG)
    now = max(_running(watch, r, step_s=0.01) for r in range(4))
    watch.allow(3, 5.0, now)
    watch.alarm(now + 0.02)
    suspects = watch.suspects(now + 0.3)
    assert suspects == [0, 1, 2]
    waiting = {"tick": 9, "phase": "recovering"}
    verdict = watch.judge({0: waiting, 1: NO_ANSWER, 2: waiting, 3: waiting}, suspects, now + 0.3)
    assert verdict.hung == [1] and verdict.dead == []


def test_an_alarm_every_rank_moved_past_is_cleared_so_the_next_one_counts() -> None:
    """A failed collective whose ranks all moved on before any round (a false alarm) suspects
    nobody; cleared then, it does not stand in the way of the next rank's alarm."""
    watch = HangWatch(CFG)
    now = max(_running(watch, r, step_s=0.01) for r in range(2))
    watch.alarm(now)
    for r in range(2):
        watch.beat(r, 10, now + 0.01, [0.01])
    assert watch.suspects(now + 0.02) == []
    watch.clear_alarm(now + 0.02)
    watch.alarm(now + 0.5)
    assert watch.alarmed_at == now + 0.5 and watch.suspects(now + 0.51) == [0, 1]


def test_a_restarted_supervisor_watches_each_rank_with_its_own_timeout() -> None:
    """The record a supervisor leaves gives its successor each rank's step time and first
    steps: a rank that hung while no supervisor watched is suspected within its own timeout
    (2 s at 0.2 s steps), not after the start-up allowance (60 s) a fresh rank gets."""
    before = HangWatch(CFG)
    _running(before, 0, step_s=0.2)
    _running(before, 1, step_s=0.01, ticks=2)  # still in its first steps
    before.started(2, 0.0)  # never reported a step: no entry
    record = before.record()
    # Rank 1's first steps' times are not kept (they have their own allowance).
    assert record == {"0": [0.2, 3], "1": [0.0, 1]}

    after = HangWatch(CFG)
    ticks = {0: 9, 1: 1, 2: -1}
    for rank in range(3):
        if not after.resumed(rank, 100.0, ticks[rank], record.get(str(rank))):
            after.started(rank, 100.0)
    assert after.timeout(0) == pytest.approx(2.0)
    assert after.timeout(1) == 20.0  # its first steps' allowance, as before
    assert after.timeout(2) == 60.0
    assert after.suspects(102.5) == [0]
    after.beat(0, 10, 102.6, [0.2])  # it moved: no longer a suspect
    assert after.suspects(103.0) == []


def test_a_record_entry_is_rebuilt_only_when_its_rank_moved_and_a_bad_one_is_not_resumed() -> None:
    watch = HangWatch(CFG)
    _running(watch, 0, step_s=0.2)
    first = watch.record()["0"]
    watch.beat(0, 10, 10.0)  # progress without step times: same entry object
    assert watch.record()["0"] is first
    watch.beat(0, 11, 10.2, [0.2])  # a step time as before: rebuilt, equal, the same object
    assert watch.record()["0"] is first
    watch.beat(0, 12, 11.2, [1.0])
    assert watch.record()["0"] == [1.0, 3]
    fresh = HangWatch(CFG)
    for bad in (None, [0.2], ["0.2", 3], [True, 3], [-1.0, 3], [0.2, 99], [float("nan"), 3]):
        assert not fresh.resumed(0, 0.0, 5, bad)
    assert not fresh.resumed(0, 0.0, -1, [0.2, 3])  # never reported: the start-up allowance
    assert not fresh.knows(0)


def test_a_replacement_keeps_the_new_process_grace_until_its_own_first_step() -> None:
    """A replacement's tick jumps from its Guard's first report (0) to the adopted step (150):
    no step of its own, so it keeps `first_step_s` (not the floor) until it reports one.
    A warm spare, a local spare (its agent's watch) and a cold start are all `started`."""
    watch = HangWatch(CFG)
    _running(watch, 1, step_s=0.01, ticks=150)
    assert watch.timeout(1) == pytest.approx(CFG.floor_s)
    watch.started(1, 100.0)  # the replacement, whichever kind
    assert watch.timeout(1) == CFG.startup_s
    watch.beat(1, 0, 100.5)  # its Guard exists
    watch.beat(1, 150, 101.0)  # it adopted the group's state at tick 150
    assert watch.timeout(1) == CFG.first_step_s
    assert watch.suspects(103.5) == []  # quiet 2.5 s after the restart: not suspected
    watch.beat(1, 151, 104.0, [0.3])  # its first step
    watch.beat(1, 155, 104.1, [0.01] * 4)
    assert watch.timeout(1) == pytest.approx(CFG.floor_s)


def test_a_ping_that_says_its_process_ran_steps_ends_the_new_process_grace() -> None:
    """A rank whose reports brought no step time yet (it hangs before its next report) but whose
    ping answer said it ran 15 steps is past the grace; a replacement's answer at its adopted
    tick with no step run keeps it."""
    watch = HangWatch(CFG)
    watch.started(1, 0.0)
    watch.beat(1, 0, 0.5)  # its Guard exists
    watch.answered(1, {"phase": "step", "tick": 15, "step": 15, "steps_run": 15}, 1.0)
    assert watch.timeout(1) == pytest.approx(CFG.floor_s)
    watch.started(2, 0.0)
    watch.beat(2, 0, 0.5)
    watch.answered(2, {"phase": "boundary", "tick": 150, "step": 150, "steps_run": 0}, 1.0)
    assert watch.timeout(2) == CFG.first_step_s


def _in_phase(tick: int, name: str, for_s: float, bound_s: float = 300.0) -> dict[str, object]:
    """A ping answer of a rank in its loop's own phase (`rank.loop.phases`)."""
    return {"tick": tick, "phase": "step", "loop_phase": {"name": name, "for_s": for_s,
                                                          "bound_s": bound_s}}  # fmt: skip


def test_a_rank_behind_in_its_own_phase_is_not_hung_within_the_phase_bound() -> None:
    """Rank 0 evaluates while rank 1 waits a tick ahead: within the eval's bound rank 0 is not
    hung however long it is behind; past the bound it is, and the reason names the phase."""
    watch = HangWatch(CFG)
    now = _running(watch, 0, step_s=0.01, ticks=11)
    _running(watch, 1, step_s=0.01, ticks=12)
    late = now + 60.0  # far past behind_s
    within = {0: _in_phase(10, "eval", 59.0, bound_s=120.0), 1: {"tick": 11, "phase": "step"}}
    assert watch.judge(within, watch.suspects(late), now=late).hung == []
    between = {0: _in_phase(10, "between_steps", 59.0), 1: {"tick": 11, "phase": "step"}}
    assert watch.judge(between, watch.suspects(late), now=late).hung == []
    past = {0: _in_phase(10, "eval", 59.0, bound_s=30.0), 1: {"tick": 11, "phase": "step"}}
    verdict = watch.judge(past, watch.suspects(late), now=late)
    assert verdict.hung == [0]
    assert "phase 'eval' for 59.0s, past its bound 30s" in verdict.reason


def test_a_phase_does_not_blind_the_watch_to_a_silent_rank() -> None:
    """Rank 0 evaluates (within bound) while rank 1 stops answering: rank 1 is named hung; a
    rank whose last answer said it was in a phase but that is silent now is named too."""
    watch = HangWatch(CFG)
    verdict = watch.judge({0: _in_phase(10, "eval", 3.0), 1: NO_ANSWER})
    assert verdict.hung == [1]
    assert watch.judge({0: NO_ANSWER, 1: {"tick": 11, "phase": "step"}}).hung == [0]


@pytest.mark.parametrize(
    "entry",
    [None, "eval", {"name": 3, "for_s": 1.0, "bound_s": 2.0}, {"name": "eval", "for_s": True,
     "bound_s": 2.0}, {"name": "eval", "for_s": 1.0}, {"name": "eval", "for_s": -1, "bound_s": 2}],
)  # fmt: skip
def test_a_malformed_or_missing_loop_phase_is_no_phase(entry: object) -> None:
    """An older rank's answer (no `loop_phase`) or a malformed one: judged as before."""
    watch = HangWatch(CFG)
    pings = {0: {"tick": 5, "phase": "step"}, 1: {"tick": 4, "phase": "step", "loop_phase": entry}}
    assert watch.judge(pings).hung == [1]


def test_phase_left_is_what_a_restart_waits_on_for_a_rank_in_its_own_code() -> None:
    """A restart waits for a survivor (or a re-formed rank) in its loop's own phase to come to
    its next step within the phase's bound (`phases.phase_left_s`): the seconds left; none
    past the bound, with no phase, or for a rank joining or recovering (not in its loop)."""
    assert phases.phase_left_s(_in_phase(10, "eval", 59.0, bound_s=120.0)) == 61.0
    assert phases.phase_left_s(_in_phase(10, "between_steps", 300.0)) == 0.0
    assert phases.phase_left_s(_in_phase(10, "eval", 59.0, bound_s=30.0)) is None
    assert phases.phase_left_s({"tick": 10, "phase": "step"}) is None  # inside a step
    assert phases.phase_left_s(NO_ANSWER) is None
    assert phases.phase_left_s(DEAD) is None
    for phase in ("joining", "recovering", "idle"):
        assert phases.phase_left_s({**_in_phase(10, "eval", 1.0), "phase": phase}) is None
