"""A node agent kills a rank by pid only when the pid is a Ray worker of its own node that started
when the rank's process did: a reused pid, or a process outside Ray, is left alone."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import ray

from remedy.supervisor.agent.actor import _not_this_process

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


@ray.remote(num_cpus=0)
class _Victim:
    def where(self) -> tuple[int, float]:
        return os.getpid(), psutil.Process().create_time()


@ray.remote(num_cpus=0)
def _check(pid: int, started: float) -> str | None:
    """The agent's check, run where an agent runs: in a Ray worker of the node."""
    return _not_this_process(pid, started)


def test_only_the_ray_worker_that_started_then_passes_the_check(ray_cluster: None) -> None:
    victim = _Victim.remote()  # type: ignore[attr-defined]
    pid, started = ray.get(victim.where.remote(), timeout=60)
    assert ray.get(_check.remote(pid, started), timeout=60) is None
    # The same pid with another start time: a process that reused it.
    reused = ray.get(_check.remote(pid, started - 5.0), timeout=60)
    assert reused is not None and reused.endswith("(pid reused)"), reused
    # The test's own process is no Ray worker of the node, whatever its start time.
    mine = psutil.Process().create_time()
    outside = ray.get(_check.remote(os.getpid(), mine), timeout=60)
    assert outside == f"refused: process {os.getpid()} is not a Ray worker of this node"
    ray.kill(victim, no_restart=True)
    deadline = time.monotonic() + 30
    while ray.get(_check.remote(pid, started), timeout=60) != "gone":
        assert time.monotonic() < deadline, "the killed actor's process is still there"
        time.sleep(0.1)
