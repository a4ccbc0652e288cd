"""`Recovery.check_hangs` carries the hang check's effects out (`core.hang_check`): it pings the
group, looks at the nodes before it reports the losses a round found (a lost node is reported
first, for all its ranks at once), and reports each to the run's core with the process the
evidence is about. Without Ray: the group's pings and the core's inputs are recorded."""

from __future__ import annotations

import asyncio
import time
import types
from typing import Any

from remedy.control.hang_watch import NO_ANSWER, HangWatch, HangWatchConfig
from remedy.control.lost_ranks import LostRanks, RankLost
from remedy.control.sections import RestartSection
from remedy.control.sightings import Sightings
from remedy.control.slots import RankSlots
from remedy.supervisor.recovery import Recovery

WORLD = 4
MOVING = {"phase": "step", "tick": 120, "step": 120}


class _Group:
    def __init__(self, order: list[str]) -> None:
        self.actors = dict.fromkeys(range(WORLD))
        self.order = order

    async def ping_all(
        self, timeout_s: float, ranks: list[int] | None = None, *, patience: float = 1.0
    ) -> dict[int, Any]:
        self.order.append(f"ping {ranks}")
        return {r: NO_ANSWER if r == 2 else MOVING for r in (ranks or self.actors)}


def test_a_round_pings_looks_at_the_nodes_then_reports_each_loss_to_the_core() -> None:
    order: list[str] = []
    inputs: list[Any] = []

    async def check_nodes(group: Any, *, now: bool) -> None:
        order.append("nodes")

    def step(inp: Any) -> list[Any]:
        order.append(f"lost {inp.rank}")
        inputs.append(inp)
        return []

    watch = HangWatch(HangWatchConfig(first_steps=0))
    slots = RankSlots(WORLD)
    slots.replace(2)  # rank 2 runs its second process
    now = time.monotonic()
    for rank in range(WORLD):
        watch.started(rank, now - 40.0)
        watch.beat(rank, 100, now - (3.0 if rank == 2 else 0.0), [0.01] * 20)
    recovery = Recovery(
        _Group(order),  # type: ignore[arg-type]
        spec=types.SimpleNamespace(workers=WORLD, node_agents="off", gpus_per_rank=0),  # type: ignore[arg-type]
        run_dir=None,  # type: ignore[arg-type]
        controller=types.SimpleNamespace(deferred={}),  # type: ignore[arg-type]
        job=None,  # type: ignore[arg-type]
        slots=slots,
        watch=watch,
        sightings=Sightings(),
        step=step,
        core=types.SimpleNamespace(lost=LostRanks(), restart=RestartSection()),  # type: ignore[arg-type]
        write_state=lambda: None,
        crash_point=lambda _: None,
        check_nodes=check_nodes,
    )
    asyncio.run(recovery.check_hangs())
    assert order == ["ping None", "nodes", "lost 2"]
    [lost] = inputs
    assert isinstance(lost, RankLost) and lost.kind == "rank_hang" and lost.incarnation == 2
    assert lost.reason.startswith("rank 2 made no progress for 3.")
