"""A ping round's verdicts: an answer, silence (`NO_ANSWER`) or death (`DEAD`), where Ray's
`ActorUnavailableError` is silence, not death (`supervisor.pings`)."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from remedy.control.hang_watch import DEAD, NO_ANSWER
from remedy.supervisor.pings import ping_actors


class _Method:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    def remote(self) -> Any:
        async def call() -> Any:
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            if self.outcome == "never":
                await asyncio.Event().wait()
            return self.outcome

        return call()


class _Actor:
    """What `ping_actors` calls: `actor.ping.remote()`, awaited."""

    def __init__(self, outcome: Any) -> None:
        self.ping = _Method(outcome)


def test_an_unavailable_actor_is_silent_and_a_died_one_dead() -> None:
    actors = {
        0: _Actor({"phase": "step", "tick": 3}),
        1: _Actor(ray.exceptions.ActorDiedError()),
        2: _Actor(ray.exceptions.ActorUnavailableError("failed to connect", None)),
        3: _Actor("never"),
    }
    got = asyncio.run(ping_actors(actors, 0.2))
    assert got == {0: {"phase": "step", "tick": 3}, 1: DEAD, 2: NO_ANSWER, 3: NO_ANSWER}
