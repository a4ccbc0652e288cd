"""A restarted supervisor learns how its adopted ranks ended without waiting on one that answers
nothing: one `result` call out per rank, looked at, never waited for."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import ray

from remedy.control.hang_watch import DEAD
from remedy.control.slots import RankSlots
from remedy.protocol.exceptions import WaitTimeout
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

    async def where(self) -> tuple[str, int, str, float]:
        if self.stuck:
            await asyncio.Event().wait()
        return ("127.0.0.1", os.getpid(), "node-a", 1.5)

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


def test_a_rank_that_does_not_say_where_it_runs_leaves_only_its_own_pid_unknown(
    ray_cluster: None,
) -> None:
    """A restarted supervisor asks its adopted ranks where they run; a stopped one used to
    leave every rank's pid unknown (their answers were gathered as one)."""
    stuck, running = _Rank.remote(stuck=True), _Rank.remote()
    # Both actors up first (`calls` answers even on the stuck one): the 1 s bound below is
    # for the stuck rank's silence, not for a fresh actor's start on a loaded machine.
    ray.get([stuck.calls.remote(), running.calls.remote()])
    group = _group({0: stuck, 1: running})
    group.pids, group.slots, group.used_nodes = {}, RankSlots(2), set()
    with pytest.raises(WaitTimeout, match=r"ranks \[0\] did not say where"):
        asyncio.run(group._learn_pids([0, 1], timeout_s=1.0))
    assert set(group.pids) == {1} and group.pids[1][1] > 0 and group.pids[1][2] == 1.5
    assert group.slots.slots[1].node == "node-a" and group.slots.slots[0].pid is None


# A restarted supervisor: a new process that finds the rank by name and polls it.
_NEW_SUPERVISOR = """
import asyncio, json, sys, time
import ray
from remedy.supervisor.worker_group import WorkerGroup
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
group = WorkerGroup.__new__(WorkerGroup)
group.actors = {0: ray.get_actor("poll-adopted-stopped", namespace="remedy-test")}
group.adopted, group._result_calls = {0}, {}
got, t0 = {}, time.monotonic()
while time.monotonic() - t0 < float(sys.argv[2]):
    got.update({str(r): v for r, v in asyncio.run(group.poll_adopted()).items()})
    time.sleep(0.5)
print(json.dumps({"got": got, "adopted": sorted(group.adopted)}))
"""


@pytest.mark.slow
def test_a_stopped_rank_is_not_taken_for_dead_by_a_new_supervisor(ray_cluster: None) -> None:
    """A new process's call to a SIGSTOPped actor fails after 22 s here with Ray's
    `ActorUnavailableError`, a `RayActorError` as the actor's death is: a restarted
    supervisor named such a rank `rank_dead`, "process is gone", 22 s after it came back.
    Polled for 35 s, it is now still adopted and asked again, as one that answers nothing
    (a dead rank is still learnt dead: the test above)."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    @ray.remote(num_cpus=0)
    class Pid:
        def pid(self) -> int:
            return os.getpid()

        def result(self) -> None:
            return None

    stopped = Pid.options(
        name="poll-adopted-stopped", namespace="remedy-test", lifetime="detached"
    ).remote()
    pid = ray.get(stopped.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        out = subprocess.run(
            [sys.executable, "-c", _NEW_SUPERVISOR, ray.get_runtime_context().gcs_address, "35"],
            check=False, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1]) == {"got": {}, "adopted": [0]}
    finally:
        os.kill(pid, signal.SIGKILL)
