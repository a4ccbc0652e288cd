"""Hang checks as a pure machine: when to ping, whom, and whom the answers name lost.

The hang watch (`core.hang_watch.HangWatch`) suspects a rank whose progress
is older than its timeout. `HangCheck` decides what to do about suspects,
once per pass of the supervisor's loop (`Look`), and goes on with what the
shell brings back (`Asked`, `Pinged`, `Reported`):

- **Without node agents**: while the watch suspects a rank, ping every rank
  (`Ping`), no sooner than `PING_EVERY_S` after the last round, and judge
  the round (`HangWatch.judge`).
- **Under node agents**: a round starts when an agent's fresh sighting holds
  a rank stalled (`core.sightings`). The agents of the ranks with no fresh
  sighting (another node's, whose agent does not suspect them yet) are
  asked to ping theirs (`AskAgents`, at most every `PING_EVERY_S`); the
  ranks whose agent did not answer (a lost node's) the supervisor pings
  itself. Each new sighting is judged again (judging pings nothing). A
  stall the supervisor's own watch sees that no agent has said anything of
  for `AGENT_QUIET_S` past the rank's timeout (an agent down or wedged) is
  pinged as without agents.
- **After a failed collective's alarm** (`alarm`): without agents, the next
  look pings every rank at once; under agents, `ALARM_GRACE_S` later, the
  ranks no agent has answered for since are pinged, and every rank is
  judged on the agents' sightings and those pings.

A verdict that names hung or dead ranks is `Found`: each loss with its
text, its details and the process (incarnation) the evidence is about.
The shell looks at the nodes first (a lost node is reported for all its
ranks at once, and a rank's own loss is then a part of it), reports the
losses to the run's core (`core.lost_ranks`), and steps `Reported`: only
then is the round over (the alarm judged, the sightings it used
forgotten), so an alarm or a sighting that comes while the losses are
reported belongs to this round.

The shell's part is I/O only: pinging, asking agents, looking at the nodes.
No Ray, no I/O and no clock here: times come with the inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from remedy.control.hang_watch import HangWatch, Verdict
from remedy.control.sightings import Sighting, Sightings
from remedy.control.stuck_at import stuck_at

# No second ping round for the same stall sooner than this.
PING_EVERY_S = 0.25
# Under node agents: how long past its timeout a rank the supervisor's watch holds
# stalled, and no agent has said anything of, waits before the supervisor pings itself.
AGENT_QUIET_S = 5.0
# Under node agents, how long after a failed collective's alarm (`HangCheck.alarm`) the
# supervisor waits for the agents' sightings before pinging the ranks none answered for: an
# agent pings its ranks within `agent.HANG_CHECK_S` of their report, and live ranks answer
# in milliseconds.
ALARM_GRACE_S = 0.15


# ------------------------------------------------------------------- inputs
@dataclass(frozen=True, slots=True)
class Look:
    """A pass of the supervisor's loop at `now` (monotonic) and `wall`; `ranks`: the ranks with
    a process (the worker group's actors)."""

    now: float
    wall: float
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Asked:
    """The agents asked (`AskAgents`) answered or timed out; their sightings are taken."""

    now: float


@dataclass(frozen=True, slots=True)
class Pinged:
    """The ranks pinged (`Ping`) answered: rank -> its status, `NO_ANSWER` or `DEAD`."""

    pings: Mapping[int, Any]
    now: float


@dataclass(frozen=True, slots=True)
class Reported:
    """The losses `Found` named are reported."""


Input = Look | Asked | Pinged | Reported


# ------------------------------------------------------------------ effects
@dataclass(frozen=True, slots=True)
class AskAgents:
    """Ask the agents of `ranks`' nodes to ping their ranks now; step `Asked` after."""

    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Ping:
    """Ping `ranks` (None: every rank of the group); step `Pinged` with the answers."""

    ranks: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class Finding:
    """`rank` is lost: `kind` `rank_hang` or `rank_dead`; `incarnation`: the process the
    evidence is about (None: the current one)."""

    rank: int
    kind: str
    reason: str
    details: Mapping[str, Any] | None
    incarnation: int | None


@dataclass(frozen=True, slots=True)
class Found:
    """Look at the nodes, report `losses` to the run's core, then step `Reported`."""

    losses: tuple[Finding, ...]


Effect = AskAgents | Ping | Found


@dataclass
class _Round:
    """A round under way between steps: what the look saw, and what was asked so far."""

    how: str  # "pings" | "agents" | "alarm"
    looked: float  # monotonic time of the look
    wall: float
    ranks: tuple[int, ...]
    stalled: dict[int, Sighting] = field(default_factory=dict)  # agents: the agents' stalls
    seen: dict[int, Sighting] = field(default_factory=dict)  # alarm: fresh since the alarm
    pings: dict[int, Any] = field(default_factory=dict)  # agents: pings from sightings
    pinged: dict[int, int] = field(default_factory=dict)  # rank -> incarnation pinged
    hit: bool = False  # its verdict named a rank (the sightings it used are forgotten after)


class HangCheck:
    """When to ping whom, and what the answers name (see the module docstring)."""

    def __init__(
        self,
        watch: HangWatch,
        sightings: Sightings,
        incarnations: Mapping[int, int],
        *,
        agents: bool,
    ) -> None:
        """`incarnations`: each rank's current process (a rank not in it: none, -1)."""
        self.watch = watch
        self.sightings = sightings
        self.incarnations = incarnations
        self.agents = agents
        self.next_ping = 0.0  # monotonic: no ping round before this
        self.suspected_at = 0.0  # wall time the current stall was first suspected
        self.ping_started = 0.0  # wall time the latest ping round began
        self.alarm_rank = -1  # the rank whose failed collective raised the watch's alarm
        self._judged = -1  # the agents' sightings (their version) last judged
        self._round: _Round | None = None

    # ---------------------------------------------------------------- alarm
    def alarm(self, rank: int, now: float, wall: float) -> bool:
        """`rank` said its collective failed: every rank that has not moved since is a suspect
        (`HangWatch.alarm`), and the next look starts a round. False: an alarm is being
        judged already. A restart under way has its own checks: the shell leaves alarms
        then."""
        if self.watch.alarmed_at is not None:
            return False
        self.watch.alarm(now)
        self.alarm_rank = rank
        self.next_ping = 0.0
        self.suspected_at = wall
        return True

    # ---------------------------------------------------------------- step
    def step(self, inp: Input) -> list[Effect]:
        match inp:
            case Look(now, wall, ranks):
                self._round = None
                if self.agents:
                    return self._look_by_agents(now, wall, ranks)
                return self._look_by_pings(now, wall, ranks)
        rnd = self._round
        if rnd is None:
            raise TypeError(f"no hang check round is under way for {inp!r}")
        match inp:
            case Asked(now):
                return self._asked(rnd, now)
            case Pinged(pings, now):
                return self._pinged(rnd, dict(pings), now)
            case Reported():
                self._finish(rnd)
                return []
        raise TypeError(f"not an input of the hang check: {inp!r}")

    # -------------------------------------------------- without agents
    def _look_by_pings(self, now: float, wall: float, ranks: tuple[int, ...]) -> list[Effect]:
        watch = self.watch
        if not watch.suspects(now):
            self.suspected_at = 0.0
            watch.clear_alarm(now)  # every rank moved since: nothing is left to look for
            return []
        self.suspected_at = self.suspected_at or wall
        if now < self.next_ping:
            return []
        self.next_ping = now + PING_EVERY_S
        self.ping_started = wall
        # Which process each answer is about: a rank replaced while the round was out (its
        # node found dead meanwhile, say) must not be judged on its old process's silence.
        pinged = {r: self.incarnations.get(r, -1) for r in ranks}
        self._round = _Round("pings", now, wall, ranks, pinged=pinged)
        return [Ping(None)]

    # ------------------------------------------------------ under agents
    def _look_by_agents(self, now: float, wall: float, ranks: tuple[int, ...]) -> list[Effect]:
        watch, sightings, inc = self.watch, self.sightings, self.incarnations
        alarm = watch.alarmed_at
        if alarm is not None:
            if now - alarm >= ALARM_GRACE_S:  # else the agents' sightings are on their way
                return self._alarm_round(alarm, now, wall, ranks)
            return []
        stalled = {r: s for r, s in sightings.stalled(now, inc).items() if watch.knows(r)}
        if not stalled:
            seen = sightings.fresh(now, inc)
            unseen = [
                r for r in watch.suspects(now)
                if r not in seen and watch.age(r, now) > watch.timeout(r) + AGENT_QUIET_S
            ]  # fmt: skip
            if unseen:
                return self._look_by_pings(now, wall, ranks)
            self.suspected_at = 0.0
            return []
        rnd = _Round("agents", now, wall, ranks, stalled=stalled)
        # Judged again on each new sighting (judging pings nothing); the agents of ranks
        # without a fresh sighting are asked at most every PING_EVERY_S.
        pings, missing = sightings.round(ranks, now, inc)
        if missing and now >= self.next_ping:
            self.next_ping = now + PING_EVERY_S
            self._round = rnd
            return [AskAgents(tuple(missing))]
        if sightings.version == self._judged:
            return []
        self._round = rnd
        return self._judge_stalled(rnd, pings, {}, now)

    def _asked(self, rnd: _Round, now: float) -> list[Effect]:
        pings, missing = self.sightings.round(rnd.ranks, now, self.incarnations)
        if missing:  # their agents did not answer: the supervisor pings them itself
            rnd.pings = pings
            rnd.pinged = {r: self.incarnations.get(r, -1) for r in missing}
            return [Ping(tuple(missing))]
        return self._judge_stalled(rnd, pings, {}, now)

    def _judge_stalled(
        self, rnd: _Round, pings: dict[int, Any], direct: dict[int, Any], judged_at: float
    ) -> list[Effect]:
        """Judge every rank on the agents' fresh sightings and the supervisor's own pings."""
        watch, sightings = self.watch, self.sightings
        self._judged = sightings.version
        self.suspected_at = min(s.suspected_at or rnd.wall for s in rnd.stalled.values())
        used = sightings.fresh(judged_at, self.incarnations)
        self.ping_started = min((used[r].pinged_at for r in pings if r in used), default=0.0)
        suspects = set(rnd.stalled) | {r for r in watch.suspects(judged_at) if r in direct}
        verdict = watch.judge({**pings, **direct}, sorted(suspects), now=judged_at)
        return self._verdict(rnd, verdict, seen=used, answers={**pings, **direct})

    def _alarm_round(
        self, alarm: float, now: float, wall: float, ranks: tuple[int, ...]
    ) -> list[Effect]:
        """`ALARM_GRACE_S` after a failed collective's alarm: the ranks no agent has answered
        for since are pinged by the supervisor (a lost node's ranks, whose agent is gone with
        them), and every rank is judged on the agents' sightings and those pings."""
        fresh = {r: s for r, s in self.sightings.fresh(now, self.incarnations).items()
                 if s.received >= alarm}  # fmt: skip
        missing = tuple(r for r in ranks if r not in fresh)
        self.ping_started = wall
        rnd = _Round("alarm", now, wall, ranks, seen=fresh,
                     pinged={r: self.incarnations.get(r, -1) for r in missing})  # fmt: skip
        self._round = rnd
        if missing:
            return [Ping(missing)]
        return self._judge_alarm(rnd, {}, now)

    def _judge_alarm(self, rnd: _Round, direct: dict[int, Any], answered: float) -> list[Effect]:
        watch = self.watch
        for rank, p in direct.items():
            watch.answered(rank, p, answered)
        pings = {**{r: s.ping for r, s in rnd.seen.items()}, **direct}
        verdict = watch.judge(pings, watch.suspects(answered), now=answered)
        return self._verdict(rnd, verdict, seen=rnd.seen, answers=pings)

    # ------------------------------------------------------------- answers
    def _pinged(self, rnd: _Round, pings: dict[int, Any], now: float) -> list[Effect]:
        if rnd.how == "agents":
            return self._judge_stalled(rnd, rnd.pings, pings, now)
        if rnd.how == "alarm":
            return self._judge_alarm(rnd, pings, now)
        watch = self.watch
        for rank, p in pings.items():
            watch.answered(rank, p, now)
        # Judged against who is still stalled after the ping (reports may have come meanwhile).
        verdict = watch.judge(pings, watch.suspects(now), now=now)
        return self._verdict(rnd, verdict, seen=None, answers=pings)

    def _verdict(
        self,
        rnd: _Round,
        verdict: Verdict,
        *,
        seen: dict[int, Sighting] | None,
        answers: Mapping[int, Any] | None = None,
    ) -> list[Effect]:
        """The round's verdict: its losses to report (`Found`), or the round is over."""
        self._round = rnd
        rnd.hit = bool(verdict.hung or verdict.dead)
        if not rnd.hit:
            self._finish(rnd)
            return []
        found = self.findings(verdict, now=rnd.looked, pinged=rnd.pinged, seen=seen)
        return [Found(tuple(stuck_at(f, answers or {}) for f in found))]

    def _finish(self, rnd: _Round) -> None:
        """The round is over: an alarm raised before it is judged, and under agents the
        sightings of a round that named a rank are forgotten (the next stall is judged on
        sightings taken after it)."""
        self._round = None
        if rnd.how in ("pings", "alarm"):
            self.watch.clear_alarm(rnd.looked)
        if rnd.hit and rnd.how in ("agents", "alarm"):
            self.sightings.clear()

    def findings(
        self,
        verdict: Verdict,
        *,
        now: float,
        pinged: dict[int, int],
        seen: dict[int, Sighting] | None,
    ) -> tuple[Finding, ...]:
        """Each hung or dead rank of a verdict as a loss, with what was seen of it. Every way
        of looking for a lost rank (the supervisor's own pings, the agents' sightings, a
        failed collective's alarm) ends here.

        `pinged`: the incarnation of each rank the supervisor pinged itself; `seen`: under
        node agents, the sightings judged on (a rank without one was pinged by the
        supervisor, its agent having said nothing). A rank the alarm alone made a suspect
        (`HangWatch.alarmed`) is named "after rank R's collective failed".
        """
        watch = self.watch
        alarmed = {r for r in verdict.hung + verdict.dead if watch.alarmed(r, now)}
        out = []
        for rank in verdict.hung + verdict.dead:
            s = seen.get(rank) if seen is not None else None
            gone = rank in verdict.dead
            details: dict[str, Any] = {}
            timeout = 0.0
            if gone:
                text = f"rank {rank}'s process is gone"
            else:
                age, timeout = (
                    (s.age_s, s.timeout_s)
                    if s is not None
                    else (watch.age(rank, now), watch.timeout(rank))
                )
                text = f"rank {rank} made no progress for {age:.2f}s"
                details = {"age_s": round(age, 3), "timeout_s": round(timeout, 3)}
            if rank in alarmed:
                text += f" after rank {self.alarm_rank}'s collective failed"
                details["alarm_rank"] = self.alarm_rank
            elif not gone:
                text += f" (timeout {timeout:.2f}s)"
            if not gone:
                text += f" and {verdict.reason}"
            if seen is not None:  # under node agents: who saw it
                seen_by = "the supervisor" if s is None else "its node's agent"
                text += f", as {seen_by} saw"
                details["found_by"] = "supervisor" if s is None else "agent"
                if s is not None:
                    details["agent_node"] = s.node
            out.append(Finding(
                rank, "rank_dead" if gone else "rank_hang", text, details or None,
                s.incarnation if s is not None else pinged.get(rank),
            ))  # fmt: skip
        return tuple(out)
