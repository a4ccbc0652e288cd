"""A restarted supervisor learns how its adopted ranks ended without waiting on one that answers
nothing: one `result` call out per rank, looked at, never waited for."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray

from remedy.supervisor.hang_watch import DEAD
from remedy.supervisor.worker_group import WorkerGroup

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


@ray.remote(num_cpus=0)
class _Rank:
    """An adopted rank: training until `finish`, or (`stuck`) answering no `result` call."""

    def __init__(self, stuck: bool = False) -> None:
        self.stuck, self.asked, self.summary = stuck, 0, None

    async def result(self) -> dict[str, Any] | None:
        self.asked += 1
        if self.stuck:
            await asyncio.Event().wait()
        return self.summary

    async def finish(self) -> None:
        self.summary = {"status": "completed", "incarnation": 1}

    async def calls(self) -> int:
        return self.asked


def _group(actors: dict[int, Any]) -> WorkerGroup:
    group = WorkerGroup.__new__(WorkerGroup)
    group.actors, group.adopted, group._result_calls = dict(actors), set(actors), {}
    return group


def _poll_until(group: WorkerGroup, want: set[int], polls: int = 400) -> dict[int, Any]:
    got: dict[int, Any] = {}
    for _ in range(polls):
        got.update(asyncio.run(group.poll_adopted()))
        if want <= set(got):
            return got
        time.sleep(0.05)
    return got


def test_a_rank_that_answers_nothing_holds_one_call_and_the_others_are_learnt(
    ray_cluster: None,
) -> None:
    stuck, training, gone = _Rank.remote(stuck=True), _Rank.remote(), _Rank.remote()
    ray.get([stuck.calls.remote(), training.calls.remote(), gone.calls.remote()])
    group = _group({0: stuck, 1: training, 2: gone})
    ray.kill(gone)
    got = _poll_until(group, {2})
    assert got == {2: DEAD}
    for _ in range(10):  # still training: asked again each time it answers None
        assert asyncio.run(group.poll_adopted()) == {}
        time.sleep(0.05)
    ray.get(training.finish.remote())
    got = _poll_until(group, {1})
    assert got == {1: {"status": "completed", "incarnation": 1}}
    assert group.adopted == {0}
    # The stuck rank got one call in all those polls, not one per poll.
    assert ray.get(stuck.calls.remote()) == 1
    assert ray.get(training.calls.remote()) > 1
