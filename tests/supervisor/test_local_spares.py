"""Where a group keeps its spares: `spares` where the fewest actors are, `local_spares` on each
node holding ranks; a lost rank's own node's spare is found, and taken, refilled, dropped with
its node. No Ray: actors are stood in for by their names."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from remedy.control.sections import GroupSection
from remedy.control.slots import RankSlots
from remedy.protocol.spec import RunSpec
from remedy.supervisor.placement import Node
from remedy.supervisor.ranks import Spares
from remedy.supervisor.worker_group import WorkerGroup

HOME, A, B = "home-node", "node-a", "node-b"


# What the run's core was sent by each group: its sections, in order (`GroupMoved`).
SENT: dict[int, list[GroupSection]] = {}


def _group(nodes: list[str], rank_nodes: list[str | None], **spec: Any) -> WorkerGroup:
    group = WorkerGroup.__new__(WorkerGroup)
    sent = SENT[id(group)] = []
    group.step, group._sent = lambda inp: sent.append(inp.group) or [], None
    group.generation, group.names = 0, {}
    group.spec = RunSpec(target="t.py:main", workers=len(rank_nodes), run_dir="/tmp/x", **spec)
    group.slots = RankSlots(len(rank_nodes))
    for rank, node in enumerate(rank_nodes):
        group.slots.slots[rank].node = node
    group.home, group.dead_nodes = HOME, set()
    group.cluster = [Node(n, f"10.0.0.{i}", 2.0) for i, n in enumerate(nodes)]
    group.spares = Spares()
    group._new_actor = lambda name, node=None: f"actor:{name}"  # type: ignore[method-assign]
    return group


def _where(group: WorkerGroup) -> dict[str, tuple[str | None, bool]]:
    return {n: (group.spares.nodes[n], n in group.spares.local) for n in group.spares.names}


def test_local_spares_sit_on_each_node_holding_ranks_besides_the_spares_apart() -> None:
    group = _group([HOME, A, B], [A, B, A, B], spares=1, local_spares=1)
    group.refill_spares()
    placed = _where(group)
    assert sorted(v for v in placed.values() if v[1]) == [(A, True), (B, True)]
    [apart] = [v for v in placed.values() if not v[1]]
    assert apart[0] in (A, B)  # where the fewest actors are, never the supervisor's node
    group.refill_spares()  # nothing missing: nothing started
    assert _where(group) == placed


def test_a_lost_ranks_own_node_spare_is_found_taken_and_refilled_there() -> None:
    group = _group([HOME, A, B], [A, B, A, B], spares=0, local_spares=1)
    group.refill_spares()
    on_a = group._local_spare(A)
    assert on_a is not None and group.spares.nodes[on_a] == A
    actor, name = group._take_spare(name=on_a)
    assert (actor, name) == (f"actor:{on_a}", on_a)
    assert group._local_spare(A) is None and name not in group.spares.local
    group.refill_spares()
    again = group._local_spare(A)
    assert again is not None and again != on_a and group.spares.nodes[again] == A


def test_a_dead_nodes_local_spares_are_dropped_and_never_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = _group([HOME, A, B], [A, B], spares=0, local_spares=2)
    group.refill_spares()
    assert sum(1 for n in group.spares.names if group.spares.nodes[n] == A) == 2
    group.dead_nodes.add(B)
    assert group._local_spare(B) is None
    group.dead_nodes.discard(B)
    killed: list[Any] = []  # `node_died` kills the dropped spares' actors
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    group.node_died(B)
    assert len(killed) == 2 and group._local_spare(B) is None
    assert {group.spares.nodes[n] for n in group.spares.local} == {A}
    # The core holds the group's section as it is now: the dead node, and the spares kept.
    last = SENT[id(group)][-1]
    assert last == group.section() and last.dead_nodes == {B}
    assert set(last.spares) == set(last.local_spares) and len(last.spares) == 2


def test_on_one_node_every_local_spare_is_the_ranks_own() -> None:
    group = _group([HOME], [None, None], spares=1, local_spares=1)
    group.refill_spares()
    assert len(group.spares.names) == 2 and len(group.spares.local) == 1
    [local] = group.spares.local
    assert group._local_spare(HOME) == local == group._local_spare(None)


def test_without_local_spares_nothing_is_kept_per_node() -> None:
    group = _group([HOME, A, B], [A, B, A, B], spares=2)
    group.refill_spares()
    assert len(group.spares.names) == 2 and not group.spares.local


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="local_spares must be 0 or more"):
        RunSpec(target="t.py:main", local_spares=-1)
