"""Hang detection: a pure heartbeat watch over each rank's progress, judged by pinging.

Each report a rank sends moves its progress (tick) and brings its step
times; so does each ping answer (`beat` with the tick the rank says it is
at). A rank is *suspect* when its tick has not moved, as far as the
supervisor knows, for longer than its timeout:

    timeout = max(floor_s, step_multiple * p99(step times))

with longer allowances while a rank starts (before its first step), during
its first `first_steps` steps, and whenever the rank is busy for longer
(adopting state after a restart: `allow`). The Guard reports only every
`heartbeat_s` (0.5 s), so a healthy rank is often quiet for longer than its
timeout: suspicion is cheap, it only triggers a ping of every rank, whose
answers either show progress (the suspicion ends) or confirm the stall.
Adding the report period to the timeout instead would add it to every
detection.

When one rank hangs inside a collective, every other rank blocks in the
same collective, so all of them stop moving. `judge` then names the hung
rank as the one that did not answer the ping (a stopped or wedged process),
or, when every rank answered, one that has stayed behind the step the others
wait at for longer than `behind_s` (a rank whose control thread still
answers but whose training is stuck; slow is not stuck, hence the longer
allowance). A rank whose actor is gone is dead, not hung.

A rank outside training on purpose (an eval or a save of its own, the time
between its steps, a compile: `rank.loop.phases`) says so in its ping answer
(`loop_phase`), with its bound. Within that bound it is never named hung for
staying behind: its peers wait for it in the next collective, which is what
a phase costs. A silent rank is named whatever phase it was in last (a
stopped process answers nothing), and one behind past its phase's bound is
named with the phase in the reason.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from remedy.protocol import phases
from remedy.protocol.phases import IN_LOOP

NO_ANSWER = None  # a ping that timed out
DEAD = "dead"  # a ping whose actor has died


def step_times(metrics: list[dict[str, Any]]) -> list[float]:
    """The step times (`step_time_s`, numbers only) of a report's step records: what
    `HangWatch.beat` sets a rank's timeout from."""
    return [
        float(m["step_time_s"])
        for m in metrics
        if isinstance(m.get("step_time_s"), int | float) and not isinstance(m["step_time_s"], bool)
    ]


@dataclass(frozen=True)
class HangWatchConfig:
    """Timeouts of the hang watch, in seconds (`RunSpec.hang_watch` takes these keys)."""

    floor_s: float = 0.5  # never suspect a rank sooner than this
    # timeout = max(floor_s, step_multiple * p99 step time). A suspicion costs one ping
    # round and the ping confirms, so this sets how soon to look, not what is judged.
    step_multiple: float = 5.0
    window: int = 50  # step times kept per rank
    startup_s: float = 120.0  # from (re)start until the rank's Guard first reports
    first_steps: int = 3  # steps that get `first_step_s` (DDP's first buckets, warm-up)
    first_step_s: float = 20.0
    # A ping unanswered this long (or `ping_patience` times the slowest answer of
    # the same round, when that is longer: a loaded node) marks the rank silent. A live
    # rank answers from a control thread, which needs the GIL and a core: a loop that runs
    # Python between its steps (an evaluation on every rank, 40 s) on a node loaded 10x over
    # its cores missed a 0.25 s ping once in ~160 rounds while its peer answered at once,
    # and was replaced. A stopped process never answers: this bounds how soon it is named.
    ping_timeout_s: float = 1.0
    ping_patience: float = 3.0
    behind_s: float = 10.0  # a rank that answers but stays behind is hung after this long


@dataclass
class _Rank:
    since: float  # when the tick last moved (or the rank started)
    tick: int = -1
    steps_seen: int = 0
    timed: int = 0  # step times received
    times: deque[float] = field(default_factory=lambda: deque(maxlen=50))
    busy_until: float = 0.0
    entry: list[float] | None = None  # its state-record entry (`HangWatch.record`)
    moved: bool = True  # its step times or first steps moved since `entry` was built
    stepped: bool = False  # this process reported a step it ran (`new_process_grace`)


@dataclass(frozen=True, slots=True)
class Verdict:
    hung: list[int]
    dead: list[int]
    reason: str


def new_process_grace(r: _Rank, config: HangWatchConfig) -> float:
    """The allowance of a process that has not run a step yet: `first_step_s` (0 after).

    Every replacement (a warm spare, a local spare, a cold start) gets it until its own
    first step, however far its tick moved before: a replacement's tick jumps from its
    Guard's first report (0) to the step it adopts, which `steps_seen` would count as
    steps run, leaving a process still warming up (its first DDP buckets, imports, a
    loaded node) to the floor timeout."""
    return 0.0 if r.stepped else config.first_step_s


class HangWatch:
    """Per-rank progress ages against adaptive timeouts."""

    def __init__(self, config: HangWatchConfig | None = None) -> None:
        self.config = config or HangWatchConfig()
        self._ranks: dict[int, _Rank] = {}
        # When a rank said its collective failed, until a ping round after it is judged
        # (`alarm`); None: no alarm.
        self.alarmed_at: float | None = None

    def started(self, rank: int, now: float) -> None:
        """A process (re)started for `rank`: a fresh history with the start-up allowance."""
        self._ranks[rank] = _Rank(since=now, times=deque(maxlen=self.config.window))

    def resumed(self, rank: int, now: float, tick: int, entry: Any) -> bool:
        """A rank the supervisor before this one watched (after a restart of the supervisor):
        past its start-up, at `tick`, with the step time its record (`record`) gives. Its
        progress is counted from `now`: whatever it did while no supervisor watched, a hang
        is then found within one timeout. False (and nothing changed) for an entry that is
        not one, or a rank that never reported: `started` is the one for it then."""
        if type(tick) is not int or tick < 0 or not isinstance(entry, list) or len(entry) != 2:
            return False
        p99, seen = entry
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in entry):
            return False
        if not (0 <= p99 < 1e6 and 0 <= seen <= self.config.first_steps):
            return False
        r = _Rank(
            since=now, tick=tick, steps_seen=int(seen), times=deque(maxlen=self.config.window)
        )
        r.timed = self.config.first_steps  # its first steps are behind it
        r.stepped = True
        if p99 > 0:
            r.times.append(float(p99))
        self._ranks[rank] = r
        return True

    def marked(self, rank: int, tick: int, since: float, ran: int) -> None:
        """`rank`'s own progress mark (`control.progress_marks`, read by a supervisor that was
        away): at `tick` since `since`, `ran` steps run by its process. Its progress age counts
        from there, and a process that has stepped is past its start-up."""
        r = self._ranks.get(rank)
        if r is None:
            r = self._ranks[rank] = _Rank(since=since, times=deque(maxlen=self.config.window))
        if tick < r.tick:
            return  # a report newer than the mark came first
        r.since = since if tick > r.tick else min(r.since, since)
        r.tick = tick
        if ran > 0:
            r.stepped = True
            r.steps_seen = max(r.steps_seen, min(ran, self.config.first_steps))

    def record(self) -> dict[str, list[float]]:
        """What a restarted supervisor needs to go on watching (`resumed`): rank -> [its p99
        step time to the ms, the steps seen up to `first_steps`], for each rank that
        reported a step. An entry is built again only when its rank's step times or first
        steps moved, and given as the same object while its value is unchanged."""
        out: dict[str, list[float]] = {}
        cap = self.config.first_steps
        for rank, r in self._ranks.items():
            if r.tick < 0:
                continue
            if r.moved or r.entry is None:
                entry = [round(self.p99(rank), 3), min(r.steps_seen, cap)]
                if entry != r.entry:
                    r.entry = entry
                r.moved = False
            out[str(rank)] = r.entry
        return out

    def forget(self, rank: int) -> None:
        self._ranks.pop(rank, None)

    def knows(self, rank: int) -> bool:
        """Whether `rank` is watched (started or beaten, and not forgotten since)."""
        return rank in self._ranks

    def beat(self, rank: int, tick: int, now: float, step_times: list[float] = ()) -> None:  # type: ignore[assignment]
        """A report from `rank` at `tick`; `step_times` are the seconds of its new steps."""
        r = self._ranks.get(rank)
        if r is None:
            r = self._ranks[rank] = _Rank(since=now, times=deque(maxlen=self.config.window))
        for t in step_times:
            r.stepped = True
            r.timed += 1
            # The first steps (DDP's first buckets, warm-up) have their own allowance;
            # kept in the window, one of them would set the timeout for the next 50 steps.
            if t >= 0 and r.timed > self.config.first_steps:
                r.times.append(t)
                r.moved = True
        if tick > r.tick:
            # The record's entry counts first steps only up to `first_steps`.
            r.moved = r.moved or r.steps_seen < self.config.first_steps
            if r.tick >= 0:
                r.steps_seen += tick - r.tick
            r.tick, r.since = tick, now

    def answered(self, rank: int, ping: Any, now: float) -> None:
        """A ping `rank` answered: one from inside its loop (phase `step` or `boundary`) says
        how far it got, progress its Guard has not reported yet (it reports every
        heartbeat_s), which ends a suspicion as a report would."""
        if phases.of(ping) in IN_LOOP:
            tick = ping.get("tick")
            if type(tick) is int:
                self.beat(rank, tick, now)
            # Its process says it ran steps (`steps_run`), which its reports may not have
            # brought yet: past the new-process grace (`new_process_grace`).
            ran = ping.get("steps_run")
            if type(ran) is int and ran > 0 and rank in self._ranks:
                self._ranks[rank].stepped = True

    def allow(self, rank: int, seconds: float, now: float) -> None:
        """`rank` may be quiet for `seconds` from now (checkpoint write, state adoption)."""
        r = self._ranks.get(rank)
        if r is not None:
            r.busy_until = max(r.busy_until, now + seconds)

    def settle(self, rank: int) -> None:
        """`rank`'s allowance (see `allow`) ends now: it is back to its step-time timeout."""
        r = self._ranks.get(rank)
        if r is not None:
            r.busy_until = 0.0

    def p99(self, rank: int) -> float:
        """The rank's 99th-percentile step time (0 before any)."""
        r = self._ranks.get(rank)
        if r is None or not r.times:
            return 0.0
        n = len(r.times)
        # The value at index min(n - 1, int(0.99 n)) of the sorted times: the k-th largest.
        k = n - min(n - 1, int(0.99 * n))
        return max(r.times) if k == 1 else heapq.nlargest(k, r.times)[-1]

    def timeout(self, rank: int) -> float:
        r = self._ranks[rank]
        c = self.config
        if r.tick < 0:
            return c.startup_s
        base = c.floor_s
        if r.times:
            base = max(base, c.step_multiple * self.p99(rank))
        if r.steps_seen < c.first_steps:
            base = max(base, c.first_step_s)
        return max(base, new_process_grace(r, c))

    def alarm(self, now: float) -> None:
        """A rank's collective failed at `now`: every rank that has not moved since is a
        suspect until `clear_alarm`, whatever its timeout. A peer killed with its node
        fails its group's collective at once, and the ping round that follows finds
        it gone, where its silence would take `floor_s` or more to be suspected."""
        if self.alarmed_at is None:
            self.alarmed_at = now

    def clear_alarm(self, judged_from: float) -> None:
        """A ping round started at `judged_from` was judged: an alarm raised before it is done."""
        if self.alarmed_at is not None and self.alarmed_at <= judged_from:
            self.alarmed_at = None

    def alarmed(self, rank: int, now: float) -> bool:
        """Whether `rank` is a suspect at `now` by the alarm alone: it has not moved since,
        and its own timeout has not run out."""
        r = self._ranks.get(rank)
        return (
            self.alarmed_at is not None
            and r is not None
            and r.since <= self.alarmed_at
            and now - r.since <= self.timeout(rank)
        )

    def suspects(self, now: float) -> list[int]:
        """Ranks whose progress is older than their timeout, or than the alarm (`alarm`)."""
        alarm = self.alarmed_at
        return sorted(
            rank
            for rank, r in self._ranks.items()
            if now > r.busy_until
            and (now - r.since > self.timeout(rank) or (alarm is not None and r.since <= alarm))
        )

    def age(self, rank: int, now: float) -> float:
        return now - self._ranks[rank].since

    def behind_for(self, rank: int, ticks: dict[int, int], now: float) -> float:
        """How long `rank` has been behind the peers ahead of it in `ticks` (a ping's): since
        the earliest of them reached the tick it holds now, or its own last progress if that
        is later. All ranks quiet together (a stretch outside `guard.step` that every rank
        runs) and one arriving a moment after the others is behind for that moment, not for
        the whole stretch."""
        ahead = [
            self._ranks[p].since for p, t in ticks.items() if t > ticks[rank] and p in self._ranks
        ]
        return min(self.age(rank, now), now - min(ahead)) if ahead else self.age(rank, now)

    def judge(
        self, pings: dict[int, Any], suspects: list[int] | None = None, now: float | None = None
    ) -> Verdict:
        """Name the hung and dead ranks from one ping of every rank.

        `pings[rank]` is the rank's status dict (`tick`, `phase`), `NO_ANSWER`
        or `DEAD`. Only `suspects` (ranks stalled past their timeout; default
        every pinged rank) can be named hung: a rank one step behind its peers
        in a ping that raced its report is not. With `now`, a rank that
        answered but is behind is named only once stalled for `behind_s`.
        """
        stalled = set(pings if suspects is None else suspects)
        dead = sorted(r for r, p in pings.items() if p == DEAD)
        silent = sorted(r for r, p in pings.items() if p is NO_ANSWER and r in stalled)
        if silent and len(silent) == len(pings):
            # Nobody answered: the node or Ray is stalled, not one rank; nothing to replace.
            silent = []
        if silent or dead:
            parts = []
            if silent:
                parts.append(f"did not answer a ping within {self.config.ping_timeout_s:g}s")
            if dead:
                parts.append("process gone")
            return Verdict(silent, dead, "; ".join(parts))
        answers = {r: p for r, p in pings.items() if isinstance(p, dict)}
        ticks = {r: int(p.get("tick", 0)) for r, p in answers.items()}
        if not ticks:
            return Verdict([], [], "")
        front = max(ticks.values())
        behind = sorted(
            r
            for r, t in ticks.items()
            if t < front
            and r in stalled
            and (now is None or self.behind_for(r, ticks, now) > self.config.behind_s)
            # Within its own phase's bound (an eval, a save) a rank is behind on purpose.
            and phases.within_phase(answers[r]) is None
        )
        if behind:
            reason = (
                f"still at tick {min(ticks[r] for r in behind)} while its peers wait at {front}"
            )
            over = [p for p in (phases.loop_phase(answers[r]) for r in behind) if p is not None]
            if over:
                name, for_s, bound_s = over[0]
                reason += f", in its phase {name!r} for {for_s:.1f}s, past its bound {bound_s:g}s"
            return Verdict(behind, [], reason)
        return Verdict([], [], "")
