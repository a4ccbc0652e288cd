"""A restart's wait for the group to step (`supervisor.step_wait.GroupSteps`): woken by reports,
it ends once every rank passed the tick, and gives up, saying why, on a failed replacement, a
rank lost meanwhile, or a deadline passed. No Ray: the ticks are fed as the report path would."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from remedy.supervisor.step_wait import GroupSteps, RestartError


async def _where() -> str:
    return "rank 1: joining in generation 2 at tick 5"


def _wait(
    steps: GroupSteps, *, joining: tuple[int, ...] = (), deadline: float = 0.0
) -> Coroutine[Any, Any, None]:
    """Wait for ranks 0 and 1 to pass tick 5, rank 1 being the replacement."""
    return steps.until_stepped(
        [0, 1], 5, [1], joining=lambda: joining, where=_where, deadline=deadline
    )


def test_the_wait_ends_once_every_rank_reported_a_tick_past_the_front() -> None:
    """Rank 0's report alone does not end it; rank 1's does, and the ticks are then dropped."""

    async def go() -> GroupSteps:
        steps = GroupSteps()
        steps.ticks = {0: -1, 1: -1}
        task = asyncio.ensure_future(_wait(steps))
        await asyncio.sleep(0)
        steps.progress(0, 6)
        await asyncio.sleep(0)
        assert not task.done()
        steps.progress(1, 6)
        await asyncio.wait_for(task, 60)
        return steps

    steps = asyncio.run(go())
    assert steps.ticks == {}
    steps.progress(0, 7)  # no restart waits: a report is not kept
    assert steps.ticks == {}


def test_a_failed_replacement_ends_the_wait_with_its_reason() -> None:
    async def go() -> None:
        steps = GroupSteps()
        steps.ticks = {0: -1, 1: -1}
        task = asyncio.ensure_future(_wait(steps))
        await asyncio.sleep(0)
        steps.fail(1, "its process died as it joined")
        await asyncio.wait_for(task, 60)

    with pytest.raises(RestartError, match="rank 1: its process died as it joined"):
        asyncio.run(go())


def test_a_rank_lost_meanwhile_and_a_passed_deadline_end_the_wait() -> None:
    """A rank joining the restart: named; a deadline already passed: where the ranks are."""
    steps = GroupSteps()
    with pytest.raises(RestartError, match="ranks 2, 3 lost while the group re-formed"):
        asyncio.run(asyncio.wait_for(_wait(steps, joining=(3, 2)), 60))
    with pytest.raises(RestartError, match=r"did not step within 120s .*rank 1: joining"):
        asyncio.run(asyncio.wait_for(_wait(steps, deadline=1.0), 60))


def test_past_the_deadline_ranks_in_their_own_phase_are_waited_on_then_given_up_on() -> None:
    """The deadline has passed with rank 1 not stepped: while `own_phase` says the ranks behind
    are in a phase of their loop's own (seconds left), the wait goes on, and a report then
    ends it; once it says 0 (no phase, or past its bound) the wait gives up."""

    async def go(lefts: list[float], report: bool) -> list[list[int]]:
        steps = GroupSteps()
        steps.ticks = {0: 6, 1: -1}
        asked: list[list[int]] = []

        async def own_phase(behind: list[int]) -> float:
            asked.append(behind)
            if report and len(asked) == 2:
                steps.progress(1, 6)
            return lefts.pop(0) if lefts else 0.0

        await steps.until_stepped([0, 1], 5, [1], joining=lambda: (), where=_where,
                                  own_phase=own_phase, deadline=1.0)  # fmt: skip
        return asked

    assert asyncio.run(go([0.01, 0.01], report=True)) == [[1], [1]]
    with pytest.raises(RestartError, match="did not step within"):
        asyncio.run(go([0.01, 0.01], report=False))
