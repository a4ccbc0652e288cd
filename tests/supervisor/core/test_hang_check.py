"""The hang check, one input at a time without Ray: when it pings and whom, when it asks the node
agents, and the one text and set of details every way of looking gives a lost rank.

Under node agents the supervisor pings ranks itself only where the agents fail it: a stall its
own watch sees that no agent speaks of (an agent down or wedged), and the ranks whose agent did
not answer its ask. The harness carries the machine's effects out as the supervisor's
`Recovery.check_hangs` does: pings answered as each test sets them, asks answered (or not) by
the agents each test names, losses recorded."""

from __future__ import annotations

import time
from typing import Any

import pytest

from remedy.control.hang_check import (
    AGENT_QUIET_S,
    ALARM_GRACE_S,
    PING_EVERY_S,
    AskAgents,
    Asked,
    Finding,
    Found,
    HangCheck,
    Look,
    Ping,
    Pinged,
    Reported,
)
from remedy.control.hang_watch import (
    DEAD,
    NO_ANSWER,
    HangWatch,
    HangWatchConfig,
    Verdict,
)
from remedy.control.sightings import Sighting, Sightings
from remedy.control.stuck_at import stuck_at

NODES = {0: "a", 1: "a", 2: "b", 3: "b"}
MOVING = {"phase": "step", "tick": 120, "step": 120}  # a rank's ping answer: it went on
REASON = "did not answer a ping within 1s"


class _Harness:
    """A hang check over a real hang watch and sightings table; its effects carried out here."""

    def __init__(self, answers: dict[int, Any], *, agents: bool = True) -> None:
        self.watch = HangWatch(HangWatchConfig(first_steps=0))
        self.sightings = Sightings()
        self.check = HangCheck(self.watch, self.sightings, dict.fromkeys(NODES, 1), agents=agents)
        self.answers = answers
        self.rounds: list[list[int]] = []  # the supervisor's own pings
        self.asked: list[list[int]] = []  # its asks to agents
        self.on_ask: dict[str, list[dict[str, Any]]] = {}  # node -> what its agent answers
        self.found: list[tuple[Finding, ...]] = []
        self.alarm_at_report: list[float | None] = []  # the watch's alarm while reporting

    def beat(self, rank: int, tick: int, ago_s: float, now: float | None = None) -> None:
        """`rank`'s newest report reached the supervisor `ago_s` seconds before `now`."""
        now = time.monotonic() if now is None else now
        self.watch.started(rank, now - ago_s - 30.0)
        self.watch.beat(rank, tick, now - ago_s, [0.01] * 20)

    def look(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        effects = self.check.step(Look(now, time.time(), tuple(NODES)))
        while effects:
            [effect] = effects
            match effect:
                case AskAgents(ranks):
                    self.asked.append(sorted(ranks))
                    for node in {NODES[r] for r in ranks}:
                        if node in self.on_ask:
                            self.sightings.add(node, self.on_ask[node], now)
                    effects = self.check.step(Asked(now))
                case Ping(ranks):
                    pinged = sorted(NODES if ranks is None else ranks)
                    self.rounds.append(pinged)
                    effects = self.check.step(Pinged({r: self.answers[r] for r in pinged}, now))
                case Found(losses):
                    self.found.append(losses)
                    self.alarm_at_report.append(self.watch.alarmed_at)
                    effects = self.check.step(Reported())


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
    h.sightings.add("a", [_sighting(0, stalled=False, ping=MOVING, age_s=0.0),
                          _sighting(1, stalled=True, ping=NO_ANSWER, age_s=3.0)],
                    time.monotonic())  # fmt: skip
    return h


# ------------------------------------------------------------ without agents
def test_without_agents_a_suspect_gets_every_rank_pinged_at_most_every_interval() -> None:
    h = _Harness({**dict.fromkeys(NODES, MOVING), 2: NO_ANSWER}, agents=False)
    now = time.monotonic()
    for rank in NODES:
        h.beat(rank, 100, ago_s=0.0, now=now)
    h.look(now)
    assert h.rounds == [] and h.check.suspected_at == 0.0  # nobody is a suspect
    h.beat(2, 90, ago_s=3.0, now=now)
    h.look(now)
    assert h.rounds == [[0, 1, 2, 3]]
    [(lost,)] = h.found
    assert (lost.rank, lost.kind, lost.incarnation) == (2, "rank_hang", 1)
    assert lost.reason.startswith("rank 2 made no progress for 3.00s (timeout ")
    assert lost.reason.endswith("and did not answer a ping within 1s")
    # No "as ... saw" without agents; where its peers wait (`stuck_at`) from their answers.
    assert set(lost.details or {}) == {"age_s", "timeout_s", "step", "tick"}
    assert (lost.details or {})["step"] == MOVING["step"]
    assert h.check.suspected_at > 0 and h.check.ping_started > 0
    h.look(now + PING_EVERY_S / 2)  # still a suspect: not pinged again so soon
    assert len(h.rounds) == 1
    h.look(now + PING_EVERY_S)
    assert len(h.rounds) == 2


def test_without_agents_an_alarm_pings_at_once_and_is_judged_once_the_losses_are_reported() -> None:
    """Rank 0's collective failed: rank 3, not moved since and within its timeout, is a suspect
    by the alarm alone; it is pinged at once (no interval to wait), found gone, and named after
    rank 0's collective. The alarm stays up until its losses are reported."""
    h = _Harness({**dict.fromkeys(NODES, MOVING), 3: DEAD}, agents=False)
    now = time.monotonic()
    for rank in NODES:
        h.beat(rank, 100, ago_s=0.1, now=now)
    h.check.next_ping = now + 10.0  # a round just now
    assert h.check.alarm(0, now, time.time())
    assert not h.check.alarm(1, now, time.time())  # one alarm at a time
    h.look(now + 0.01)
    assert h.rounds == [[0, 1, 2, 3]]
    [(dead,)] = h.found
    assert dead.reason == "rank 3's process is gone after rank 0's collective failed"
    assert dead.details == {"alarm_rank": 0, "step": 120, "tick": 120}
    assert h.alarm_at_report == [now]  # judged after the report, not before
    assert h.watch.alarmed_at is None


def test_a_round_left_unfinished_is_dropped_by_the_next_look() -> None:
    h = _Harness(dict.fromkeys(NODES, MOVING), agents=False)
    now = time.monotonic()
    for rank in NODES:
        h.beat(rank, 100, ago_s=3.0, now=now)
    assert h.check.step(Look(now, time.time(), tuple(NODES))) == [Ping(None)]
    # The shell's ping failed (the look's task was cancelled): the next look starts afresh.
    assert h.check.step(Look(now + PING_EVERY_S, time.time(), tuple(NODES))) == [Ping(None)]
    fresh = _Harness(dict.fromkeys(NODES, MOVING), agents=False).check
    with pytest.raises(TypeError, match="no hang check round"):
        fresh.step(Asked(now))  # an answer with no round under way


# ---------------------------------------------------------------- under agents
def test_a_stall_no_agent_speaks_of_is_pinged_by_the_supervisor_only_after_the_quiet_time() -> None:
    """Node b's agent is wedged: its ranks' digests stopped, and no sighting of them comes. The
    supervisor waits the ranks' timeout plus AGENT_QUIET_S, then pings every rank itself; they
    answer with progress (training went on), so nothing is lost."""
    h = _Harness(dict.fromkeys(NODES, MOVING))
    for rank in (0, 1):
        h.beat(rank, 100, ago_s=0.0)
    for rank in (2, 3):
        h.beat(rank, 5, ago_s=AGENT_QUIET_S - 2.0)  # suspect, but the agent may still speak
    h.look()
    assert h.rounds == [] and h.found == []
    for rank in (2, 3):
        h.beat(rank, 5, ago_s=AGENT_QUIET_S + 1.0)
    h.look()
    assert h.rounds == [[0, 1, 2, 3]]  # the supervisor's own round, every rank
    assert h.found == []
    assert h.watch.suspects(time.monotonic()) == []  # the answers moved the watch


def test_a_hung_rank_behind_a_wedged_agent_is_found_by_the_supervisors_pings() -> None:
    """The same wedged agent, and rank 3 hung behind it: it does not answer the supervisor's
    ping, so it is named hung, as the supervisor saw (no sighting of it)."""
    h = _Harness({**dict.fromkeys(NODES, MOVING), 3: NO_ANSWER})
    for rank in (0, 1):
        h.beat(rank, 100, ago_s=0.0)
    for rank in (2, 3):
        h.beat(rank, 5, ago_s=AGENT_QUIET_S + 1.0)
    h.look()
    [(lost,)] = h.found
    assert lost.rank == 3 and lost.kind == "rank_hang" and lost.incarnation == 1


def test_ranks_whose_agent_does_not_answer_the_ask_are_pinged_by_the_supervisor() -> None:
    """Node a's agent holds rank 1 stalled (its ping unanswered). The supervisor asks node b's
    agent for its ranks; it does not answer (its node lost, say), so the supervisor pings ranks
    2 and 3 itself, and only those. They answer; rank 1 is named hung on its agent's sighting."""
    h = _rank_1_stalled_on_node_a()
    h.look()
    assert h.asked == [[2, 3]]
    assert h.rounds == [[2, 3]]
    [(lost,)] = h.found
    assert lost.rank == 1 and lost.incarnation == 1
    assert lost.details == {"age_s": 3.0, "timeout_s": 0.5, "found_by": "agent", "agent_node": "a",
                            "step": 120, "tick": 120}  # fmt: skip
    assert lost.reason.endswith(", as its node's agent saw")
    # Forgotten once reported.
    assert h.sightings.fresh(time.monotonic(), dict.fromkeys(range(4), 1)) == {}


def test_ranks_whose_agent_answers_the_ask_are_not_pinged_by_the_supervisor() -> None:
    """Node b's agent answers the ask with its ranks' sightings: the supervisor pings no rank."""
    h = _rank_1_stalled_on_node_a()
    h.on_ask["b"] = [_sighting(r, stalled=False, ping=MOVING, age_s=0.0) for r in (2, 3)]
    h.look()
    assert h.asked == [[2, 3]] and h.rounds == []
    [(lost,)] = h.found
    assert lost.rank == 1 and (lost.details or {})["found_by"] == "agent"


def test_a_sighting_judged_once_is_not_judged_again_until_a_new_one_comes() -> None:
    """Node b's agent answered the ask; a second look within the interval neither asks again nor
    judges the same sightings again; a new sighting is judged (judging pings nothing)."""
    h = _Harness(dict.fromkeys(NODES, MOVING))
    now = time.monotonic()
    for rank in NODES:
        h.beat(rank, 100, ago_s=0.0, now=now)
    h.beat(1, 90, ago_s=0.4, now=now)
    stalled_1 = _sighting(1, stalled=True, ping=MOVING, age_s=0.4)  # it answered: slow, not hung
    h.sightings.add("a", [_sighting(0, stalled=False, ping=MOVING, age_s=0.0), stalled_1], now)
    h.on_ask["b"] = [_sighting(r, stalled=False, ping=MOVING, age_s=0.0) for r in (2, 3)]
    h.look(now)
    assert h.asked == [[2, 3]] and h.found == []
    version = h.sightings.version
    h.look(now + 0.01)
    assert h.asked == [[2, 3]] and h.sightings.version == version  # nothing new: nothing done
    h.sightings.add("a", [{**stalled_1, "ping": "no_answer", "age_s": 3.0}], now + 0.02)
    h.look(now + 0.03)
    assert h.asked == [[2, 3]] and h.rounds == []  # judged on the sightings it holds
    [(lost,)] = h.found
    assert lost.rank == 1


def test_under_agents_an_alarm_waits_for_their_sightings_then_pings_the_ranks_none_answered_for() -> (
    None
):
    """Rank 0's collective failed. Within ALARM_GRACE_S nothing is done (the agents' sightings
    are on their way); then node a's agent has sighted its ranks since the alarm, node b's has
    not (the node is gone): the supervisor pings ranks 2 and 3, finds them gone, names them
    after rank 0's collective, as the supervisor saw."""
    h = _Harness({**dict.fromkeys(NODES, MOVING), 2: DEAD, 3: DEAD})
    now = time.monotonic()
    for rank in NODES:
        h.beat(rank, 100, ago_s=0.1, now=now)
    assert h.check.alarm(0, now, time.time())
    h.look(now + ALARM_GRACE_S / 2)
    assert h.rounds == [] and h.found == []
    h.sightings.add("a", [_sighting(r, stalled=False, ping=MOVING, age_s=0.0) for r in (0, 1)],
                    now + 0.05)  # fmt: skip
    # Past the grace (not at it: `(now + grace) - now` is not `grace` in floating point).
    h.look(now + ALARM_GRACE_S + 0.01)
    assert h.rounds == [[2, 3]]
    [losses] = h.found
    assert [(f.rank, f.kind) for f in losses] == [(2, "rank_dead"), (3, "rank_dead")]
    assert losses[0].reason == (
        "rank 2's process is gone after rank 0's collective failed, as the supervisor saw"
    )
    assert losses[0].details == {
        "alarm_rank": 0,
        "found_by": "supervisor",
        "step": 120,
        "tick": 120,
    }
    assert h.watch.alarmed_at is None and h.alarm_at_report == [now]


# ------------------------------------------------------------------ findings
def _watch(now: float) -> HangWatch:
    watch = HangWatch()
    for rank in range(4):
        watch.started(rank, now - 30.0)
        watch.beat(rank, 5, now - 20.0)
    return watch


def _check(watch: HangWatch) -> HangCheck:
    return HangCheck(watch, Sightings(), dict.fromkeys(range(4), 1), agents=False)


def test_the_supervisors_own_pings() -> None:
    """Without agents: no 'as ... saw'; the process named is the one pinged."""
    now = 1000.0
    check = _check(_watch(now))
    assert check.findings(Verdict([], [], ""), now=now, pinged={}, seen=None) == ()
    hung, dead = check.findings(Verdict([1], [2], REASON), now=now, pinged={1: 3, 2: 1}, seen=None)
    assert hung.kind == "rank_hang" and hung.incarnation == 3
    assert hung.reason.startswith("rank 1 made no progress for 20.00s (timeout ")
    assert hung.reason.endswith(f"and {REASON}")
    assert set(hung.details or {}) == {"age_s", "timeout_s"}
    assert dead == Finding(2, "rank_dead", "rank 2's process is gone", None, 1)


def test_the_agents_sightings_say_who_saw() -> None:
    """A rank with a sighting is judged on its agent's age and timeout and incarnation; one
    without was pinged by the supervisor itself."""
    now = 1000.0
    check = _check(_watch(now))
    seen = {1: Sighting(1, 7, "n2", True, None, 4.5, 2.0, 990.0, 991.0)}
    by_agent, by_supervisor = check.findings(
        Verdict([1, 3], [], REASON), now=now, pinged={3: 2}, seen=seen
    )
    assert by_agent.reason == (
        f"rank 1 made no progress for 4.50s (timeout 2.00s) and {REASON}, as its node's agent saw"
    )
    assert by_agent.details == {"age_s": 4.5, "timeout_s": 2.0, "found_by": "agent",
                                "agent_node": "n2"}  # fmt: skip
    assert by_agent.incarnation == 7
    assert by_supervisor.reason.endswith(", as the supervisor saw")
    assert (by_supervisor.details or {})["found_by"] == "supervisor"
    assert by_supervisor.incarnation == 2


def test_a_rank_suspect_by_the_alarm_alone_is_named_after_the_failed_collective() -> None:
    """Rank 0's collective failed: rank 2, not moved since and within its timeout, is named
    after it; its reason and details say so, dead or hung."""
    now = 1000.0
    watch = HangWatch()
    for rank in range(4):
        watch.started(rank, now - 1.0)
        watch.beat(rank, 5, now - 0.5)
    check = _check(watch)
    check.alarm(0, now - 0.2, 5000.0)
    hung, dead = check.findings(Verdict([2], [3], REASON), now=now, pinged={2: 1, 3: 1}, seen={})
    assert hung.reason == (
        f"rank 2 made no progress for 0.50s after rank 0's collective failed and {REASON}, "
        "as the supervisor saw"
    )
    assert (hung.details or {})["alarm_rank"] == 0
    assert dead.reason == (
        "rank 3's process is gone after rank 0's collective failed, as the supervisor saw"
    )
    assert dead.details == {"alarm_rank": 0, "found_by": "supervisor"}


def test_a_hung_rank_is_found_at_the_step_its_peers_wait_in_not_its_last_report() -> None:
    """Rank 2 last reported tick 138 and went silent; its peers answer the ping from inside
    step 150, where they wait for it: the finding says step 150. A rank that answers but is
    stuck says its own step."""
    waiting = {"phase": "step", "tick": 150, "step": 150}
    h = _Harness({**dict.fromkeys(NODES, waiting), 2: NO_ANSWER}, agents=False)
    now = time.monotonic()
    for rank in NODES:
        h.beat(rank, 150, ago_s=0.0, now=now)
    h.beat(2, 138, ago_s=3.0, now=now)
    h.look(now)
    [(lost,)] = h.found
    assert (lost.details or {})["step"] == 150 and (lost.details or {})["tick"] == 150
    behind = stuck_at(lost, {2: {"phase": "step", "tick": 149, "step": 149}, 0: waiting})
    assert ((behind.details or {})["step"], (behind.details or {})["age_s"]) == (149, 3.0)
