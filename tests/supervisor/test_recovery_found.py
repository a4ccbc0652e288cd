"""Every way of looking for a lost rank ends in `Recovery._found`: one text and set of details
for what was seen, whichever path (the supervisor's pings, the agents' sightings, an alarm)."""

from __future__ import annotations

import asyncio
from typing import Any

from remedy.supervisor.agent_hang import Sighting
from remedy.supervisor.core.hang_watch import HangWatch, Verdict
from remedy.supervisor.recovery import Recovery

REASON = "did not answer a ping within 0.25s"


def _recovery(watch: HangWatch) -> tuple[Recovery, list[dict[str, Any]], list[str]]:
    """A Recovery whose `lost` and node check are recorded, not carried out."""
    lost: list[dict[str, Any]] = []
    order: list[str] = []

    async def check_nodes(group: Any, *, now: bool) -> None:
        order.append("nodes")

    rec = Recovery.__new__(Recovery)
    rec.watch, rec.group, rec.check_nodes, rec._alarm_rank = watch, None, check_nodes, -1

    def record(rank: int, kind: str, reason: str, **kw: Any) -> None:
        order.append(f"lost {rank}")
        lost.append({"rank": rank, "kind": kind, "reason": reason, **kw})

    rec.lost = record  # type: ignore[method-assign]
    return rec, lost, order


def _watch(now: float) -> HangWatch:
    watch = HangWatch()
    for rank in range(4):
        watch.started(rank, now - 30.0)
        watch.beat(rank, 5, now - 20.0)
    return watch


def test_the_supervisors_own_pings() -> None:
    """Without agents: no 'as ... saw'; the node check comes before the losses; nothing to
    report is nothing done."""
    now = 1000.0
    rec, lost, order = _recovery(_watch(now))
    asyncio.run(rec._found(Verdict([], [], ""), now=now, pinged={}))
    assert order == []
    asyncio.run(rec._found(Verdict([1], [2], REASON), now=now, pinged={1: 3, 2: 1}))
    assert order == ["nodes", "lost 1", "lost 2"]
    hung, dead = lost
    assert hung["kind"] == "rank_hang" and hung["incarnation"] == 3
    assert hung["reason"].startswith("rank 1 made no progress for 20.00s (timeout ")
    assert hung["reason"].endswith(f"and {REASON}")
    assert set(hung["details"]) == {"age_s", "timeout_s"}
    assert dead == {"rank": 2, "kind": "rank_dead", "reason": "rank 2's process is gone",
                    "details": None, "incarnation": 1}  # fmt: skip


def test_the_agents_sightings_say_who_saw() -> None:
    """A rank with a sighting is judged on its agent's age and timeout and incarnation; one
    without was pinged by the supervisor itself."""
    now = 1000.0
    rec, lost, _ = _recovery(_watch(now))
    seen = {1: Sighting(1, 7, "n2", True, None, 4.5, 2.0, 990.0, 991.0)}
    asyncio.run(rec._found(Verdict([1, 3], [], REASON), now=now, pinged={3: 2}, seen=seen))
    by_agent, by_supervisor = lost
    assert by_agent["reason"] == (
        f"rank 1 made no progress for 4.50s (timeout 2.00s) and {REASON}, as its node's agent saw"
    )
    assert by_agent["details"] == {"age_s": 4.5, "timeout_s": 2.0, "found_by": "agent",
                                   "agent_node": "n2"}  # fmt: skip
    assert by_agent["incarnation"] == 7
    assert by_supervisor["reason"].endswith(", as the supervisor saw")
    assert by_supervisor["details"]["found_by"] == "supervisor"
    assert by_supervisor["incarnation"] == 2


def test_a_rank_suspect_by_the_alarm_alone_is_named_after_the_failed_collective() -> None:
    """Rank 0's collective failed: rank 2, not moved since and within its timeout, is named
    after it; its reason and details say so, dead or hung."""
    now = 1000.0
    watch = HangWatch()
    for rank in range(4):
        watch.started(rank, now - 1.0)
        watch.beat(rank, 5, now - 0.5)
    watch.alarm(now - 0.2)
    rec, lost, _ = _recovery(watch)
    rec._alarm_rank = 0
    asyncio.run(rec._found(Verdict([2], [3], REASON), now=now, pinged={2: 1, 3: 1}, seen={}))
    hung, dead = lost
    assert hung["reason"] == (
        f"rank 2 made no progress for 0.50s after rank 0's collective failed and {REASON}, "
        "as the supervisor saw"
    )
    assert hung["details"]["alarm_rank"] == 0
    assert dead["reason"] == (
        "rank 3's process is gone after rank 0's collective failed, as the supervisor saw"
    )
    assert dead["details"] == {"alarm_rank": 0, "found_by": "supervisor"}
