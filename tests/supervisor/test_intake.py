"""The supervisor's intake of agent calls: an anomaly's call is taken ahead of the digests
waiting, its own agent's digests first, and no call is answered before a record covers it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from remedy.supervisor.intake import BATCH, Intake, urgent


class Log:
    """What the intake did, in order: ("take", node, tag), ("record", n taken so far)."""

    def __init__(self, *, fail_records: int = 0) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.taken = 0
        self.recorded = 0  # takes covered by the last record
        self.fail_records = fail_records

    def take(self, node: str, items: list[Any]) -> set[int]:
        self.taken += 1
        self.events.append(("take", node, items[0]["tag"]))
        return {items[0]["rank"]}

    def record(self) -> None:
        if self.fail_records:
            self.fail_records -= 1
            raise OSError("disk full")
        self.recorded = self.taken
        self.events.append(("record", self.taken))

    def answer(self, ranks: set[int]) -> dict[int, list[Any]]:
        assert self.recorded == self.taken, "answered before a record covered every take"
        return {r: [] for r in ranks}

    def intake(self) -> Intake:
        return Intake(self.take, self.record, self.answer)

    def takes(self) -> list[str]:
        return [e[2] for e in self.events if e[0] == "take"]


def digest(tag: str, rank: int = 0) -> list[dict[str, Any]]:
    return [{"tag": tag, "rank": rank, "events": [], "metrics": []}]


def anomaly(tag: str, rank: int = 0) -> list[dict[str, Any]]:
    return [{"tag": tag, "rank": rank, "events": [{"kind": "data_stall"}]}]


def test_what_is_urgent() -> None:
    assert urgent(anomaly("a"))
    assert urgent([{"events": [], "collective_failed": True}])
    assert not urgent(digest("d"))
    assert not urgent([None, "x", {"events": None}])


def test_an_anomaly_is_taken_ahead_of_other_agents_digests_but_after_its_own() -> None:
    """Digests of nodes a, b, a, c wait; b's anomaly comes: b's digest, then the anomaly are
    taken and recorded at once, answered before the others are taken; they follow in order."""
    log = Log()

    async def main() -> list[str]:
        intake = log.intake()
        waiting = [
            asyncio.ensure_future(intake.call(n, digest(f"{n}{i}"))) for i, n in enumerate("abac")
        ]
        while log.taken < 1:  # the four are queued; the worker has taken the first
            await asyncio.sleep(0)
        answered = await intake.call("b", anomaly("B"))
        assert answered == {0: []}
        at_answer = log.takes()
        await asyncio.gather(*waiting)
        assert intake.overtaken == 2 and intake.urgent_calls == 1
        return at_answer

    at_answer = asyncio.run(main())
    assert at_answer == ["a0", "b1", "B"]
    assert log.takes() == ["a0", "b1", "B", "a2", "c3"]
    # The anomaly's record covered the digest the worker had taken before it.
    assert ("record", 3) in log.events


def test_digests_are_answered_after_one_record_and_at_least_every_batch() -> None:
    log = Log()

    async def main() -> None:
        intake = log.intake()
        calls = [intake.call("n", digest(f"d{i}")) for i in range(BATCH * 2 + 5)]
        await asyncio.gather(*calls)

    asyncio.run(main())
    records = [e[1] for e in log.events if e[0] == "record"]
    assert records == [BATCH, 2 * BATCH, 2 * BATCH + 5]


def test_a_record_that_fails_fails_the_calls_it_covered_and_the_next_ones_go_on() -> None:
    """The first record fails: the digests it covered raise (their agents send them again);
    the intake keeps working, and the anomaly's call raises if its own record fails."""
    log = Log(fail_records=1)

    async def main() -> None:
        intake = log.intake()
        first = [asyncio.ensure_future(intake.call("n", digest(f"d{i}"))) for i in range(3)]
        results = await asyncio.gather(*first, return_exceptions=True)
        assert all(isinstance(r, OSError) for r in results), results
        assert await intake.call("n", digest("later")) == {0: []}
        log.fail_records = 1
        with pytest.raises(OSError, match="disk full"):
            await intake.call("n", anomaly("A"))
        assert await intake.call("n", anomaly("B")) == {0: []}

    asyncio.run(main())


def refusing(log: Log, tag: str) -> Callable[[str, list[Any]], set[int]]:
    """`log.take`, raising for the items tagged `tag`."""

    def take(node: str, items: list[Any]) -> set[int]:
        if items[0]["tag"] == tag:
            raise ValueError("no")
        return log.take(node, items)

    return take


def test_a_take_that_raises_fails_only_its_own_call() -> None:
    log = Log()

    async def main() -> None:
        intake = Intake(refusing(log, "bad"), log.record, log.answer)
        results = await asyncio.gather(
            intake.call("n", digest("ok1")),
            intake.call("n", digest("bad")),
            intake.call("n", digest("ok2")),
            return_exceptions=True,
        )
        assert results[0] == {0: []} and results[2] == {0: []}
        assert isinstance(results[1], ValueError)

    asyncio.run(main())


def test_an_anomaly_that_raises_still_answers_its_agents_digests_taken_before_it() -> None:
    log = Log()

    async def main() -> None:
        intake = Intake(refusing(log, "bad"), log.record, log.answer)
        mine = asyncio.ensure_future(intake.call("n", digest("d")))
        await asyncio.sleep(0)  # queued, not taken yet
        with pytest.raises(ValueError, match="no"):
            await intake.call("n", anomaly("bad"))
        assert await asyncio.wait_for(mine, 1) == {0: []}

    asyncio.run(main())
