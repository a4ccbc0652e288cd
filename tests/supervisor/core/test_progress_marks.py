"""A returning supervisor's hang watch, set from the ranks' own progress marks: a rank that hung
while it was away is a suspect at once, and named from one ping round."""

from __future__ import annotations

import pytest

from remedy.control.hang_watch import DEAD, NO_ANSWER, HangWatch, HangWatchConfig
from remedy.control.progress_marks import Mark, marks

WALL, NOW = 10_000.0, 500.0  # the epoch clock of the marks, the watch's monotonic clock
CFG = HangWatchConfig(floor_s=0.5, startup_s=120.0, first_steps=3, first_step_s=20.0)


def answer(tick: int, moved_ago: float, *, phase: str = "step", ran: int = 40) -> dict[str, object]:
    return {"phase": phase, "tick": tick, "step": tick, "moved_at": WALL - moved_ago,
            "steps_run": ran}  # fmt: skip


def test_each_answer_dates_its_ranks_progress_and_a_silent_rank_takes_the_groups_oldest() -> None:
    """Ranks 0 and 2 wait in tick 150's collective since 16 s and 15 s ago; rank 1 does not
    answer: it stopped the group, at tick 150, 16 s ago. A dead rank gets no mark."""
    pings = {0: answer(150, 16.0), 1: NO_ANSWER, 2: answer(150, 15.0), 3: DEAD}
    got = marks(pings, wall=WALL, now=NOW)
    assert got == {0: Mark(150, NOW - 16.0, 40), 1: Mark(150, NOW - 16.0, 40),
                   2: Mark(150, NOW - 15.0, 40)}  # fmt: skip


def test_no_silent_rank_is_dated_while_a_peer_is_outside_its_loop() -> None:
    """A restart was under way (a peer re-forming the group): the silent rank may be a
    replacement still starting; it gets no mark, nor does the recovering rank."""
    pings = {0: answer(150, 3.0, phase="recovering"), 1: NO_ANSWER}
    assert marks(pings, wall=WALL, now=NOW) == {}
    # A mark from a clock ahead of this one is taken as moving just now.
    assert marks({0: answer(150, -5.0)}, wall=WALL, now=NOW) == {0: Mark(150, NOW, 40)}


def test_a_rank_hung_while_the_supervisor_was_away_is_named_from_the_marks() -> None:
    """The predecessor died before it recorded the ranks: both start with the start-up
    allowance (not suspects for 120 s). Their marks say 16 s without progress: both are
    suspects at once, and the round's verdict names the silent one."""
    watch = HangWatch(CFG)
    for rank in (0, 1):
        watch.started(rank, NOW)
    assert watch.suspects(NOW + 1.0) == []
    pings = {0: answer(150, 16.0), 1: NO_ANSWER}
    for rank, m in marks(pings, wall=WALL, now=NOW).items():
        watch.marked(rank, m.tick, m.since, m.ran)
    assert watch.timeout(1) == pytest.approx(CFG.floor_s)
    assert watch.suspects(NOW) == [0, 1]
    verdict = watch.judge(pings, watch.suspects(NOW), now=NOW)
    assert verdict.hung == [1]


def test_a_mark_older_than_what_the_watch_knows_changes_nothing_and_a_fresh_process_keeps_its_grace() -> (
    None
):
    """A report at tick 151 came before the mark of tick 150: the mark is stale. A replacement
    that ran no step of its own keeps the new-process grace whatever its tick."""
    watch = HangWatch(CFG)
    watch.started(0, NOW - 30.0)
    watch.beat(0, 151, NOW - 0.1, [0.01] * 5)
    watch.marked(0, 150, NOW - 16.0, 40)
    assert watch.age(0, NOW) == pytest.approx(0.1)
    watch.started(1, NOW - 2.0)
    watch.marked(1, 150, NOW - 2.0, 0)
    assert watch.timeout(1) == CFG.first_step_s
