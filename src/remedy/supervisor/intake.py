"""Node agents' calls in: an anomaly is taken ahead of the digests waiting to be taken.

A node agent sends the supervisor two kinds of `report_many` call
(`supervisor.agent`): a digest of its ranks' reports every interval (bulk:
hundreds a second at 4,096 ranks, none of them waited on by a training step),
and, at once, the report of a rank that raised an anomaly or whose collective
failed (urgent: the decision on it, a rollback or a replay, is what the ranks
wait for). Taken in arrival order, an urgent call waits for every digest that
came before it, and for their state record: under load, tens of milliseconds.

`Intake` takes the digests one at a time on its own task, letting the event
loop run between two (`asyncio.sleep(0)`), so an urgent call that arrives
meanwhile is taken at once: after the digest being taken, not after the
queue. Its own agent's digests still waiting are taken first, in the order
they came, so that one rank's reports are never taken out of the order its
agent sent them. An urgent call writes its state record at once and is
answered; digests are answered after a record that covers them, written once
the queue is empty or every `BATCH` digests (one record answers many calls,
as before).

Crash safety is as before: no call is answered before a state record covers
what it changed, and a call not yet taken when the supervisor dies was never
answered, so its agent sends it again to the restarted supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Digests taken before their state record is written even though more are waiting: a
# bound on how long a digest's answer waits under sustained load.
BATCH = 64


def urgent(items: list[Any]) -> bool:
    """Whether a call's items carry what its agent sends at once: anomaly events, or a
    rank whose collective failed (`AgentCore.take`)."""
    return any(
        isinstance(item, dict)
        and (bool(item.get("events")) or item.get("collective_failed") is True)
        for item in items
    )


@dataclass
class _Call:
    node: str
    items: list[Any]
    answered: asyncio.Future[dict[int, list[Any]]] = field(repr=False)
    ranks: set[int] | None = None  # once taken: the ranks to answer for


class Intake:
    """The supervisor's intake of agent calls (see the module docstring).

    `take(node, items)`: take the items (the controller's work), returning the
    ranks the answer covers; `record()`: write a state record covering every
    change so far (raises if it could not); `answer(ranks)`: the reply.
    """

    def __init__(
        self,
        take: Callable[[str, list[Any]], set[int]],
        record: Callable[[], None],
        answer: Callable[[set[int]], dict[int, list[Any]]],
    ) -> None:
        self._take, self._record, self._answer = take, record, answer
        self._queue: deque[_Call] = deque()
        self._taken: list[_Call] = []  # taken, waiting for a state record
        self._worker: asyncio.Task[None] | None = None
        self.urgent_calls = 0
        self.overtaken = 0  # digests an urgent call was taken ahead of

    async def call(self, node: str, items: list[Any]) -> dict[int, list[Any]]:
        """One agent call: its answer once a state record covers it."""
        if urgent(items):
            return self._urgent(node, items)
        call = _Call(node, items, asyncio.get_running_loop().create_future())
        self._queue.append(call)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._work())
        return await call.answered

    def _urgent(self, node: str, items: list[Any]) -> dict[int, list[Any]]:
        self.urgent_calls += 1
        own = [c for c in self._queue if c.node == node]
        for c in own:
            self._queue.remove(c)
        self.overtaken += len(self._queue)
        for c in own:  # this agent's digests first, in the order it sent them
            self._take_one(c)
        try:
            ranks = self._take(node, items)
        finally:  # the digests taken above are answered even if these items raised
            self._settle()  # raises if the record failed: this call fails, as the digests do
        return self._answer(ranks)

    def _take_one(self, call: _Call) -> None:
        try:
            call.ranks = self._take(call.node, call.items)
        except Exception as exc:  # this call fails; its agent sends it again
            _fail(call, exc)
        else:
            self._taken.append(call)

    def _settle(self) -> None:
        """A state record over everything taken, then the answers of the digests it covers.
        A record that could not be written fails them (their agents send them again) and
        raises."""
        taken, self._taken = self._taken, []
        try:
            self._record()
        except Exception as exc:
            for c in taken:
                _fail(c, exc)
            raise
        for c in taken:
            if not c.answered.done():  # a call its caller gave up on is taken all the same
                c.answered.set_result(self._answer(c.ranks or set()))

    async def _work(self) -> None:
        try:
            since_record = 0
            while self._queue or self._taken:
                if self._queue:
                    self._take_one(self._queue.popleft())
                    since_record += 1
                if not self._queue or since_record >= BATCH:
                    since_record = 0
                    with contextlib.suppress(Exception):  # failed the calls it covered
                        self._settle()
                await asyncio.sleep(0)  # an urgent call that came meanwhile is taken now
        except BaseException as exc:  # cancelled: nothing may wait forever on this task
            for c in (*self._taken, *self._queue):
                _fail(c, RuntimeError(f"the supervisor's intake stopped: {exc!r}"))
            self._taken.clear()
            self._queue.clear()
            raise


def _fail(call: _Call, exc: Exception) -> None:
    if not call.answered.done():
        call.answered.set_exception(exc)
