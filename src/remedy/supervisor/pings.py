"""Pinging rank actors: one round, each rank's answer, silence, or death.

Used by the supervisor's ping rounds (`WorkerGroup.ping_all`) and by a node
agent over its own ranks (`supervisor.agent`). A rank answers `ping` from its
control concurrency group, so a rank blocked in a collective still answers in
milliseconds; one that does not is stopped or wedged.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from remedy.control.hang_watch import DEAD, NO_ANSWER

# How long a warm spare gets to answer before it is used, whoever uses it (the supervisor,
# `WorkerGroup`, or a node agent promoting it, `NodeAgent.promote`): one that does not
# (stopped, wedged) is killed, skipped, and replaced by a fresh spare.
SPARE_PING_S = 1.0

# Ray's `RayActorError` is either `ActorDiedError` (the process is gone) or
# `ActorUnavailableError`, which says nothing of the process: a caller that cannot
# reach it gets one. A call from a new process to a SIGSTOPped actor raises it
# after 22 s here (Ray 2.60: "failed to connect to all addresses ... connection
# attempt timed out"), which a restarted supervisor's calls to the ranks it adopted
# met, and took for death ("rank 3's process is gone"). It counts as no answer
# everywhere remedy calls a rank: the hang watch judges the silence, and a dead
# process shows as `ActorDiedError`.


async def ping_actors(
    actors: dict[int, Any], timeout_s: float, *, patience: float = 0.0
) -> dict[int, Any]:
    """Each rank actor's `ping` answer, `NO_ANSWER` if it did not answer in time, or `DEAD`.

    In time: within `timeout_s`, or `patience` times the slowest answer
    received, when that is longer (on a loaded node every answer is slow).
    The supervisor's ping round, and a node agent's over its own ranks.
    """

    async def one(actor: Any) -> Any:
        try:
            return await actor.ping.remote()  # caller bounds: asyncio.wait below
        except ray.exceptions.ActorUnavailableError:
            return NO_ANSWER  # not known to be dead (above)
        except ray.exceptions.RayActorError:
            return DEAD

    t0 = time.monotonic()
    tasks = {rank: asyncio.ensure_future(one(a)) for rank, a in actors.items()}
    deadline = t0 + timeout_s
    pending = set(tasks.values())
    while pending:
        done, pending = await asyncio.wait(
            pending, timeout=max(0.0, deadline - time.monotonic()),
            return_when=asyncio.FIRST_COMPLETED,
        )  # fmt: skip
        if not done:
            break
        deadline = max(deadline, t0 + patience * (time.monotonic() - t0))
    out: dict[int, Any] = {}
    for rank, task in tasks.items():
        if task.done():
            out[rank] = task.result()  # done
        else:
            task.cancel()
            out[rank] = NO_ANSWER
    return out
