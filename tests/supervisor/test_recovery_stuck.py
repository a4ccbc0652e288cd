"""The recovery's survivor check against ranks' ping answers: a survivor still `joining` a
generation after the grace is replaced, one that leaves the rendezvous in time is not, and
a launch with a rank still joining it is not taken as formed (`workers.phases.JOINING`), and
survivors under a framework's loop, which never re-form the group, are not waited for."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable
from typing import Any

from remedy.control import restart
from remedy.control.hang_watch import HangWatch
from remedy.control.lost_ranks import LostRanks
from remedy.control.restart import RestartState, Stage
from remedy.control.run_core import RestartMoved
from remedy.control.sections import RestartSection
from remedy.control.slots import RankSlots
from remedy.protocol import phases
from remedy.supervisor.recovery import Recovery

WORLD = 4


class Group:
    """The worker group as the survivor check sees it: ping answers, kills, abandoned stores."""

    def __init__(self, answer: Callable[[int, int], dict[str, Any]]) -> None:
        self.answer = answer  # (rank, ping round) -> the rank's status
        self.rounds = 0
        self.killed: list[int] = []
        self.abandoned = 0
        self.actors: dict[int, Any] = {}

    async def ping_all(
        self, timeout_s: float, ranks: list[int] | None = None, *, patience: float = 0.0
    ) -> dict[int, Any]:
        self.rounds += 1
        return {r: self.answer(r, self.rounds) for r in (ranks or range(WORLD))}

    def kill(self, rank: int) -> None:
        self.killed.append(rank)

    def abandon_generation(self) -> None:
        self.abandoned += 1


def moved(core: Any, inp: Any) -> list[Any]:
    """The core's step as far as these tests go: a restart's move is held."""
    if isinstance(inp, RestartMoved):
        core.restart = inp.restart
    return []


def _recovery(group: Group) -> tuple[Recovery, list[int]]:
    dropped: list[int] = []
    lost = LostRanks()

    async def nothing(*_: Any, **__: Any) -> None:
        return None

    # The run's core as far as a restart reads and moves it: its losses and its section.
    core = types.SimpleNamespace(lost=lost, restart=RestartSection())
    recovery = Recovery(
        group,
        spec=types.SimpleNamespace(workers=WORLD, node_agents="off", gpus_per_rank=0),
        run_dir=None,
        controller=types.SimpleNamespace(drop_rank=dropped.append, tick_of={}),
        job=None,
        slots=RankSlots(WORLD),
        watch=HangWatch(),
        sightings=None,
        step=lambda inp: moved(core, inp),
        core=core,
        write_state=lambda: None,
        crash_point=lambda _: None,
        check_nodes=nothing,
    )
    return recovery, dropped


def _status(phase: str, generation: int, regroups: bool | None = True) -> dict[str, Any]:
    return {"phase": phase, "generation": generation, "tick": 5, "step": 5, "regroups": regroups}


def _check(recovery: Recovery, *, retry: bool) -> restart.RestartInput | None:
    machine = RestartState("d1", WORLD, Stage.CHECK, (3,), first=not retry)
    decision: Any = None
    return asyncio.run(
        recovery._carry(decision, machine, restart.CheckSurvivors((0, 1, 2), retry=retry))
    )


def test_a_survivor_still_joining_after_the_grace_is_replaced_as_stuck() -> None:
    """Before a relaunch: the failed generation is abandoned first (its store's waits fail),
    then rank 2, still joining it, is killed and handed back as stuck, not as blocked."""
    group = Group(
        lambda r, _: _status(phases.JOINING, 1) if r == 2 else _status(phases.RECOVERING, 0)
    )
    recovery, dropped = _recovery(group)
    checked = _check(recovery, retry=True)
    assert checked == restart.Checked(blocked=(), joined=(), stuck=(2,))
    assert group.abandoned == 1 and group.killed == [2] and dropped == [2]
    assert recovery.slots.slots[2].state.value == "lost"
    assert "survivors_checked" not in recovery._marks  # a relaunch's check: not the record's


def test_a_survivor_whose_rendezvous_fails_within_the_grace_is_kept() -> None:
    """Its rendezvous failed as the store closed: it waits for the order, and is not replaced.
    A survivor in its loop (not in the group's recovery) is blocked, not stuck."""

    def answer(rank: int, round_: int) -> dict[str, Any]:
        if rank == 2:
            return _status(phases.JOINING if round_ < 3 else phases.RECOVERING, 0)
        if rank == 1:
            return _status(phases.STEP, 0)
        return _status(phases.RECOVERING, 0)

    group = Group(answer)
    recovery, _ = _recovery(group)
    checked = _check(recovery, retry=False)
    assert checked == restart.Checked(blocked=(1,), joined=(), stuck=())
    assert group.abandoned == 0 and group.killed == [1]
    assert "survivors_checked" in recovery._marks


def test_a_launch_with_a_rank_still_joining_it_is_not_formed() -> None:
    """After a supervisor crash: every rank names the launched generation, but rank 2 is
    still in its rendezvous, so the crashed supervisor's launch did not take."""
    joining = Group(lambda r, _: _status(phases.JOINING if r == 2 else phases.BOUNDARY, 1))
    assert asyncio.run(_recovery(joining)[0]._formed(1)) is False
    formed = Group(lambda r, _: _status(phases.BOUNDARY, 1))
    assert asyncio.run(_recovery(formed)[0]._formed(1)) is True


def test_survivors_under_a_frameworks_loop_are_replaced_without_waiting() -> None:
    """Lightning's or Hugging Face's loop owns the process group: a survivor there is still in
    its loop, and says it never re-forms the group (`regroups` False, `Membership.framework_loop`).
    The check hands every such survivor back, apart, after one ping round, where survivors
    whose regrouping is not known are waited for through the grace (every one still blocked:
    the grace and `SILENT_GRACE_S`, about 5 s)."""
    group = Group(lambda r, _: _status(phases.STARTING, 0, regroups=False))
    recovery, dropped = _recovery(group)
    checked = _check(recovery, retry=False)
    assert checked == restart.Checked(blocked=(), joined=(), stuck=(), framework=(0, 1, 2))
    assert group.rounds == 1 and group.killed == [0, 1, 2] and dropped == [0, 1, 2]
    unknown = Group(lambda r, _: _status(phases.STEP, 0, regroups=None) if r == 1
                    else _status(phases.RECOVERING, 0))  # fmt: skip
    recovery, _ = _recovery(unknown)
    assert _check(recovery, retry=False) == restart.Checked(blocked=(1,), joined=(), stuck=())
    assert unknown.rounds > 1  # waited through the grace for rank 1 to catch the error
