"""Under node agents the supervisor pings ranks itself only where the agents fail it: a stall its
own watch sees that no agent speaks of (an agent down or wedged), and the ranks whose agent did
not answer its ask. Stepped without Ray: `Recovery._check_by_agents` over a real hang watch and
sightings table, with the group's pings and the agents' asks recorded."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from remedy.supervisor.agent_hang import Sightings
from remedy.supervisor.core.hang_watch import NO_ANSWER, HangWatch, HangWatchConfig, Verdict
from remedy.supervisor.recovery import AGENT_QUIET_S, Recovery

NODES = {0: "a", 1: "a", 2: "b", 3: "b"}
MOVING = {"phase": "step", "tick": 120, "step": 120}  # a rank's ping answer: it went on


@dataclass
class _Slot:
    incarnation: int
    node: str


class _Slots:
    def __init__(self) -> None:
        self.slots = {r: _Slot(1, n) for r, n in NODES.items()}

    def incarnation(self, rank: int) -> int:
        return self.slots[rank].incarnation


class _Group:
    """The ranks' actors, pinged by the supervisor: each answer as the test sets it."""

    def __init__(self, answers: dict[int, Any]) -> None:
        self.actors = dict.fromkeys(NODES)
        self.answers = answers
        self.rounds: list[list[int]] = []

    async def ping_all(
        self, timeout_s: float, ranks: list[int] | None = None, *, patience: float = 1.0
    ) -> dict[int, Any]:
        asked = sorted(self.actors if ranks is None else ranks)
        self.rounds.append(asked)
        return {r: self.answers[r] for r in asked}


class _Harness:
    """A Recovery under node agents whose verdicts and asks to agents are recorded."""

    def __init__(self, answers: dict[int, Any]) -> None:
        rec = Recovery.__new__(Recovery)
        rec.watch = HangWatch(HangWatchConfig(first_steps=0))
        rec.sightings = Sightings()
        rec.group = _Group(answers)  # type: ignore[assignment]
        rec.slots = _Slots()  # type: ignore[assignment]
        rec._next_ping, rec._judged, rec._suspected_at, rec._ping_started = 0.0, -1, 0.0, 0.0
        self.rec, self.group = rec, rec.group
        self.found: list[tuple[Verdict, dict[int, int], set[int]]] = []
        self.asked: list[list[int]] = []
        self.on_ask: dict[str, list[dict[str, Any]]] = {}  # node -> what its agent answers

        async def found(verdict: Verdict, *, now: float, pinged: dict[int, int],
                        seen: dict[int, Any] | None = None) -> None:  # fmt: skip
            self.found.append((verdict, pinged, set(seen or {})))

        async def ask_agents(ranks: list[int]) -> None:
            self.asked.append(sorted(ranks))
            for node in {NODES[r] for r in ranks}:
                if node in self.on_ask:
                    rec.sightings.add(node, self.on_ask[node], time.monotonic())

        rec._found = found  # type: ignore[method-assign]
        rec._ask_agents = ask_agents  # type: ignore[method-assign]

    def beat(self, rank: int, tick: int, ago_s: float) -> None:
        """`rank`'s newest digest reached the supervisor `ago_s` seconds ago, at `tick`."""
        now = time.monotonic()
        self.rec.watch.started(rank, now - ago_s - 30.0)
        self.rec.watch.beat(rank, tick, now - ago_s, [0.01] * 20)

    def check(self) -> None:
        asyncio.run(self.rec._check_by_agents())


def _sighting(rank: int, *, stalled: bool, ping: Any, age_s: float) -> dict[str, Any]:
    """One rank in an agent's `hang_seen` call, as `sighting_items` writes it."""
    wire = ping if isinstance(ping, dict) else "no_answer"
    now = time.time()
    return {"rank": rank, "incarnation": 1, "stalled": stalled, "ping": wire, "age_s": age_s,
            "timeout_s": 0.5, "suspected_at": now - 1.0 if stalled else 0.0,
            "pinged_at": now}  # fmt: skip


def _rank_1_stalled_on_node_a() -> _Harness:
    """Every rank moving but rank 1, which node a's agent has just seen stalled and silent."""
    h = _Harness(dict.fromkeys(NODES, MOVING))
    for rank in NODES:
        h.beat(rank, 100, ago_s=0.0)
    h.beat(1, 90, ago_s=3.0)
    h.rec.sightings.add("a", [_sighting(0, stalled=False, ping=MOVING, age_s=0.0),
                              _sighting(1, stalled=True, ping=NO_ANSWER, age_s=3.0)],
                        time.monotonic())  # fmt: skip
    return h


def test_a_stall_no_agent_speaks_of_is_pinged_by_the_supervisor_only_after_the_quiet_time() -> None:
    """Node b's agent is wedged: its ranks' digests stopped, and no sighting of them comes. The
    supervisor waits the ranks' timeout plus AGENT_QUIET_S, then pings every rank itself; they
    answer with progress (training went on), so nothing is lost."""
    h = _Harness(dict.fromkeys(NODES, MOVING))
    for rank in (0, 1):
        h.beat(rank, 100, ago_s=0.0)
    for rank in (2, 3):
        h.beat(rank, 5, ago_s=AGENT_QUIET_S - 2.0)  # suspect, but the agent may still speak
    h.check()
    assert h.group.rounds == [] and h.found == []
    for rank in (2, 3):
        h.beat(rank, 5, ago_s=AGENT_QUIET_S + 1.0)
    h.check()
    assert h.group.rounds == [[0, 1, 2, 3]]  # the supervisor's own round, every rank
    ((verdict, pinged, seen),) = h.found
    assert (verdict.hung, verdict.dead) == ([], []) and seen == set()
    assert pinged == dict.fromkeys(NODES, 1)
    assert h.rec.watch.suspects(time.monotonic()) == []  # the answers moved the watch


def test_a_hung_rank_behind_a_wedged_agent_is_found_by_the_supervisors_pings() -> None:
    """The same wedged agent, and rank 3 hung behind it: it does not answer the supervisor's
    ping, so it is named hung, as the supervisor saw (no sighting of it)."""
    answers: dict[int, Any] = {**dict.fromkeys(NODES, MOVING), 3: NO_ANSWER}
    h = _Harness(answers)
    for rank in (0, 1):
        h.beat(rank, 100, ago_s=0.0)
    for rank in (2, 3):
        h.beat(rank, 5, ago_s=AGENT_QUIET_S + 1.0)
    h.check()
    ((verdict, _, seen),) = h.found
    assert verdict.hung == [3] and verdict.dead == [] and seen == set()


def test_ranks_whose_agent_does_not_answer_the_ask_are_pinged_by_the_supervisor() -> None:
    """Node a's agent holds rank 1 stalled (its ping unanswered). The supervisor asks node b's
    agent for its ranks; it does not answer (its node lost, say), so the supervisor pings ranks
    2 and 3 itself, and only those. They answer; rank 1 is named hung on its agent's sighting."""
    h = _rank_1_stalled_on_node_a()
    h.check()
    assert h.asked == [[2, 3]]
    assert h.group.rounds == [[2, 3]]
    ((verdict, pinged, seen),) = h.found
    assert verdict.hung == [1] and seen == {0, 1} and pinged == {2: 1, 3: 1}


def test_ranks_whose_agent_answers_the_ask_are_not_pinged_by_the_supervisor() -> None:
    """Node b's agent answers the ask with its ranks' sightings: the supervisor pings no rank."""
    h = _rank_1_stalled_on_node_a()
    h.on_ask["b"] = [_sighting(r, stalled=False, ping=MOVING, age_s=0.0) for r in (2, 3)]
    h.check()
    assert h.asked == [[2, 3]] and h.group.rounds == []
    ((verdict, pinged, seen),) = h.found
    assert verdict.hung == [1] and seen == {0, 1, 2, 3} and pinged == {}
