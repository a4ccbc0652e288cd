"""Hang detection under node agents, without Ray: the agents' watch and pings, the supervisor's judging."""

from __future__ import annotations

import math
import time
from typing import Any

from remedy.control.hang_watch import DEAD, NO_ANSWER, HangWatch, HangWatchConfig
from remedy.control.sightings import (
    AGENT_PING_EVERY_S,
    FRESH_S,
    RECOVERING_QUIET_S,
    Sighting,
    Sightings,
    sighting_items,
)
from remedy.supervisor.agent.core import AgentCore

TOKEN = "t" * 32
# Short allowances: a rank is suspect 0.5 s after its last tick once it has taken 3 steps.
CONFIG = HangWatchConfig(first_steps=0, first_step_s=0.0)


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def report(rank: int, seq: int, step: int, *, incarnation: int = 1, **extra: Any) -> dict[str, Any]:
    """A Guard's report at `step` with that step's record (10 ms a step)."""
    now = time.time()
    return {
        "rank": rank, "step": step, "tick": step, "ts": now, "incarnation": incarnation,
        "seq": seq, "token": TOKEN, "outcomes": [], "events": [],
        "metrics": [{"step": step - 1, "tick": step - 1, "rank": rank, "loss": 2.0,
                     "step_time_s": 0.01, "mem_bytes": 5}],
        **extra,
    }  # fmt: skip


def agent(clock: Clock) -> AgentCore:
    return AgentCore(node="n1", token=TOKEN, world_size=4, clock=clock, hang_watch=CONFIG)


def steps_to(core: AgentCore, clock: Clock, rank: int, last: int, seq0: int = 1) -> None:
    for i, step in enumerate(range(1, last + 1)):
        clock.t += 0.01
        assert core.take(report(rank, seq0 + i, step)).ok


def test_the_agent_watch_suspects_a_silent_rank_and_paces_its_pings() -> None:
    """Reports move the agent's watch; after the timeout a ping is due, then not again for
    AGENT_PING_EVERY_S; the stall's first suspicion time is kept across rounds."""
    clock = Clock()
    core = agent(clock)
    steps_to(core, clock, 1, 10)
    assert core.watched() == [1]
    assert not core.ping_due()
    clock.t += 0.6  # past max(floor 0.5, 5 x 10 ms)
    assert core.ping_due()
    first = core.suspected_at
    assert first == clock.t
    clock.t += AGENT_PING_EVERY_S / 2
    assert not core.ping_due()
    clock.t += AGENT_PING_EVERY_S
    assert core.ping_due() and core.suspected_at == first
    # A report ends the stall: nothing is due, and the next stall is a new one.
    assert core.take(report(1, 11, 11)).ok
    assert not core.ping_due() and core.suspected_at == 0.0


def test_a_ping_answered_from_inside_the_loop_ends_the_suspicion() -> None:
    """The rank stepped on since its last report: its answer moves the watch, the sighting
    says it is not stalled."""
    clock = Clock()
    core = agent(clock)
    steps_to(core, clock, 2, 10)
    clock.t += 0.6
    assert core.ping_due()
    [item] = core.sightings({2: {"phase": "step", "tick": 14, "step": 14, "pid": 7}}, clock.t)
    assert item["stalled"] is False and item["ping"] == {"phase": "step", "tick": 14, "step": 14}
    assert item["incarnation"] == 1 and item["suspected_at"] == 0.0


def test_a_dead_rank_is_reported_once_then_no_longer_watched_until_a_new_process_reports() -> None:
    clock = Clock()
    core = agent(clock)
    steps_to(core, clock, 3, 10)
    clock.t += 0.6
    [item] = core.sightings({3: DEAD}, clock.t)
    assert item["ping"] == DEAD and item["stalled"] is True
    assert core.watched() == []
    # Its replacement reports here: watched again, from that report on.
    clock.t += 5.0
    assert core.take(report(3, 1, 10, incarnation=2)).ok
    assert core.watched() == [3] and core.incarnation(3) == 2
    assert core.watch.age(3, clock.t) == 0.0 and not core.ping_due()


def test_an_ending_rank_is_not_watched() -> None:
    """A rank whose loop is done takes no more steps: no progress is waited for."""
    clock = Clock()
    core = agent(clock)
    steps_to(core, clock, 0, 5)
    assert core.take(report(0, 6, 6, ending=True)).ok
    clock.t += 60
    assert core.watched() == [] and not core.ping_due()


def test_a_collective_hang_across_two_nodes_is_named_only_from_both_agents_sightings() -> None:
    """Rank 1 (node a) is stopped; rank 0 (node b) blocks in the collective at the next step.

    Node a's agent alone sees one silent rank, which `judge` does not name (nobody
    answered: the node or Ray stalled); node b's sees a rank that answers. The
    supervisor, holding both, names rank 1 hung."""
    clock = Clock()
    a, b = agent(clock), agent(clock)
    for step in range(1, 11):
        clock.t += 0.01
        assert a.take(report(1, step, step)).ok and b.take(report(0, step, step)).ok
    clock.t += 0.6
    assert a.ping_due() and b.ping_due()
    from_a = a.sightings({1: NO_ANSWER}, clock.t)
    from_b = b.sightings({0: {"phase": "step", "tick": 10, "step": 10}}, clock.t)
    alone = HangWatch(CONFIG)
    assert alone.judge({1: NO_ANSWER}).hung == []

    sup = Sightings()
    incarnation = {0: 1, 1: 1}
    sup.add("a", from_a, now=100.0)
    pings, missing = sup.round([0, 1], 100.0, incarnation)
    assert missing == [0] and pings == {1: NO_ANSWER}
    sup.add("b", from_b, now=100.1)
    stalled = sup.stalled(100.2, incarnation)
    assert sorted(stalled) == [0, 1] and stalled[1].node == "a"
    pings, missing = sup.round([0, 1], 100.2, incarnation)
    assert missing == []
    verdict = HangWatch(CONFIG).judge(pings, sorted(stalled))
    assert verdict.hung == [1] and verdict.dead == []


def test_stale_sightings_and_those_of_replaced_processes_take_no_part() -> None:
    sup = Sightings()
    watch = HangWatch(CONFIG)
    watch.beat(0, 10, 0.0)
    items = sighting_items(watch, {0: NO_ANSWER}, {0: 1}, now=1.0, suspected_at=5.0, pinged_at=6.0)
    assert items[0]["stalled"] is True and items[0]["age_s"] == 1.0
    sup.add("a", items, now=50.0)
    assert list(sup.stalled(50.0 + FRESH_S, {0: 1})) == [0]
    assert sup.stalled(50.0 + FRESH_S + 0.01, {0: 1}) == {}
    # Rank 0 was replaced (incarnation 2): the old process's sighting is about nothing running.
    assert sup.stalled(50.0, {0: 2}) == {}
    # A newer incarnation's sighting is not overwritten by a late one of the old process.
    newer = [{**items[0], "incarnation": 2, "ping": {"phase": "step", "tick": 3}}]
    sup.add("b", newer, now=51.0)
    assert sup.add("a", items, now=51.5) == []
    assert sup.fresh(51.5, {0: 2})[0].node == "b"


def test_sightings_that_are_not_plain_bounded_data_are_refused() -> None:
    good = {"rank": 1, "incarnation": 1, "stalled": True, "ping": "no_answer", "age_s": 1.0,
            "timeout_s": 0.5, "suspected_at": 1.0, "pinged_at": 1.0}  # fmt: skip
    assert Sighting.from_wire("a", good, 0.0) is not None
    bad = [
        {**good, "rank": True},
        {**good, "rank": -1},
        {**good, "incarnation": "1"},
        {**good, "age_s": math.inf},
        {**good, "pinged_at": None},
        {**good, "ping": "maybe"},
        {**good, "ping": {"tick": "ten"}},
        {**good, "ping": {"tick": 3, "phase": 4}},
        "a sighting",
    ]
    sup = Sightings()
    assert sup.add("a", bad, 0.0) == [] and sup.refused == len(bad)
    assert sup.add("a", "not a list", 0.0) == [] and sup.refused == len(bad) + 1
    [taken] = sup.add("a", [good], 0.0)
    assert taken.ping is NO_ANSWER and taken.stalled


def test_a_sighting_keeps_the_ranks_loop_phase_as_a_plain_entry() -> None:
    """A rank's loop phase (`rank.loop.phases`) travels in its sighting for the supervisor's
    verdict; a malformed one is dropped, an overlong name cut, the sighting kept."""
    base = {"rank": 1, "incarnation": 1, "stalled": True, "age_s": 1.0, "timeout_s": 0.5,
            "suspected_at": 1.0, "pinged_at": 1.0}  # fmt: skip
    phase = {"name": "eval", "for_s": 2.5, "bound_s": 300.0, "extra": "x" * 10}
    taken = Sighting.from_wire("a", {**base, "ping": {"tick": 3, "loop_phase": phase}}, 0.0)
    assert taken is not None and isinstance(taken.ping, dict)
    assert taken.ping["loop_phase"] == {"name": "eval", "for_s": 2.5, "bound_s": 300.0}
    long = {**phase, "name": "e" * 1000}
    taken = Sighting.from_wire("a", {**base, "ping": {"tick": 3, "loop_phase": long}}, 0.0)
    assert taken is not None and isinstance(taken.ping, dict)
    assert taken.ping["loop_phase"]["name"] == "e" * 64
    taken = Sighting.from_wire("a", {**base, "ping": {"tick": 3, "loop_phase": [1, 2]}}, 0.0)
    assert taken is not None and taken.ping == {"tick": 3}


def test_a_failed_collective_makes_the_agent_ping_its_ranks_at_once() -> None:
    """A rank's report says its collective failed: a ping of this node's ranks is due at once,
    far inside their timeout and the pacing of the last round; the ranks that have not moved
    since are sighted stalled (so the sightings go up), and the round ends the alarm."""
    clock = Clock()
    core = agent(clock)
    steps_to(core, clock, 0, 10)
    steps_to(core, clock, 1, 10, seq0=1)
    clock.t += 0.6
    assert core.ping_due()  # an ordinary round: the next one is paced
    assert core.take(report(0, 11, 11)).ok and core.take(report(1, 11, 11)).ok
    assert not core.ping_due()
    clock.t += 0.02
    assert core.take(report(1, 12, 11, collective_failed=True)).ok
    assert core.ping_due()
    waiting = {"phase": "recovering", "tick": 11, "step": 11}
    items = core.sightings({0: waiting, 1: waiting}, clock.t)
    assert [i["stalled"] for i in items] == [True, True]
    assert core.watch.alarmed_at is None
    clock.t += 0.01
    assert not core.ping_due()


def test_ranks_in_their_groups_recovery_are_left_unpinged_for_a_while() -> None:
    """Survivors waiting for the order to regroup, or adopting state, answer `recovering`. The
    round that found them so goes up as it is (stalled: the alarm's round needs them), then no
    round is due for RECOVERING_QUIET_S however long the adoption takes: a long one would
    otherwise bring a round of sightings every AGENT_PING_EVERY_S from every agent. A rank
    that moves again is watched by its step time at once."""
    clock = Clock()
    core = agent(clock)
    steps_to(core, clock, 0, 10)
    steps_to(core, clock, 1, 10, seq0=1)
    clock.t += 0.6  # past the 0.5 s timeout: both suspect
    assert core.ping_due()
    waiting = {"phase": "recovering", "tick": 10, "step": 10}
    items = core.sightings({0: waiting, 1: waiting}, clock.t)
    assert [i["stalled"] for i in items] == [True, True]
    rounds = 0
    for _ in range(int((RECOVERING_QUIET_S - 0.1) / AGENT_PING_EVERY_S)):
        clock.t += AGENT_PING_EVERY_S
        rounds += core.ping_due()
    assert rounds == 0
    clock.t += 0.4  # the quiet time is over: still not moving, so it is looked at again
    assert core.ping_due()
    items = core.sightings({0: waiting, 1: waiting}, clock.t)
    assert [i["stalled"] for i in items] == [True, True]
    # Rank 0 regrouped and stepped: back to its step-time timeout at once (rank 1 still quiet).
    assert core.take(report(0, 11, 11, regrouped=True)).ok
    clock.t += 0.6
    assert core.watch.suspects(clock.t) == [0]


def test_an_alarm_the_ranks_moved_past_is_dropped_and_the_next_one_pings() -> None:
    """The agent's alarm whose ranks all reported since (nothing to ping for) is dropped when
    the watch is next looked at, so a later failed collective pings at once again."""
    clock = Clock()
    core = agent(clock)
    steps_to(core, clock, 0, 10)
    assert core.take(report(0, 11, 10, collective_failed=True)).ok
    clock.t += 0.01
    assert core.take(report(0, 12, 11)).ok  # moved on before the agent looked
    assert not core.ping_due() and core.watch.alarmed_at is None
    clock.t += 0.01
    assert core.take(report(0, 13, 11, collective_failed=True)).ok
    assert core.ping_due()
