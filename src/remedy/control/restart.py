"""A restart of lost ranks as a pure machine: `step(state, job, input) -> (state, effects)`.

`restart_rank` replaces the lost ranks only: kill their processes, check that
the survivors caught the broken collective's error, launch replacements in
the next generation from the lowest healthy rank's state, and wait until
every rank stepped in it. A failed attempt goes through the same steps
again after a jittered back-off (its replacements killed, the survivors
checked again: one stuck in the failed generation's rendezvous is replaced
too), into the generation after the failed one, over a new rendezvous
store (the failed generation's keys name processes that are gone, and
survivors that formed it wait for an order past it). After
`max_targeted_restarts` failed attempts the whole group restarts from the
last checkpoint every rank committed; if that fails too, the run ends. Which of these comes next is
decided here, and only here; `supervisor.recovery.Recovery` carries each
effect out (Ray calls, pings, timers) and feeds back what happened.

No Ray, no torch, no I/O and no clock. The job's phase is the job state
machine's (`supervisor.core.job_state.transition`): the machine hands its inputs
on as `Job` effects, computing the same transition to know where the job
goes. `RestartState` is part of the supervisor's state record, written
before each effect is carried out, so a supervisor killed at any point of a
restart finds where it stood and goes on from there (`Resume`).

    begin -> kill -> check -> launch -> step -> done
               ^                         | failed
               |                         v
               +------------------- backoff       (attempts left)
                                         | no attempts left, or no survivor
                                         v
                                        all -> done                 (every rank from a checkpoint)

With no healthy rank left to take the state from (a node that held every
rank), no targeted attempt can work: the whole group restarts at once.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from remedy.control.job import (
    MAX_TARGETED_ATTEMPTS,
    Input,
    JobState,
    Phase,
    RanksLost,
    Regrouped,
    RestartFailed,
    transition,
)

SCHEMA = 1
# A replaced rank and its peers must each complete a step in the new generation within
# this long of the launch, or the attempt failed. The deadline is in the state record: a
# supervisor restarted while the group re-forms waits out the rest of it, not a new one.
REGROUP_TIMEOUT_S = 120.0
# What a restart that never tried a targeted attempt says when it ends as a full one.
TARGETED_OFF = "targeted restarts are off (max_targeted_restarts is 0)"
_UNDER_WAY = (Phase.RECOVERING, Phase.RESTARTING_ALL)
NO_SOURCE = "no healthy rank is left to take the state from"
NONE_RECOVERED = "no survivor recovered from the broken collective"
STILL_BLOCKED = "still blocked in the broken collective"
# A survivor that formed no generation since a peer died in its rendezvous: gloo waits
# for that peer's connection without a timeout (`workers.phases.JOINING`).
STUCK_JOINING = "still in the rendezvous of a generation that can no longer form"
# A survivor whose loop a framework drives (Lightning's, Hugging Face's): a failed collective
# is raised through that loop and ends the rank (`workers.phases.regroups`).
FRAMEWORK_LOOP = (
    "in a framework's loop, which a failed collective ends (it cannot re-form the process "
    "group and go on)"
)
NONE_CAN_REGROUP = (
    "the survivors run a framework's loop, which a failed collective ends: none can re-form "
    "the process group and go on"
)


class Stage(enum.StrEnum):
    BEGIN = "begin"  # decided; nothing done yet
    KILL = "kill"  # an attempt from the start: the lost ranks' processes are killed
    CHECK = "check"  # killed: are the survivors out of the broken collective?
    LAUNCH = "launch"  # replacements are being started
    STEP = "step"  # launched: every rank must step in the new generation
    BACKOFF = "backoff"  # an attempt failed: a jittered pause before the next
    ALL = "all"  # every rank restarts from the last committed checkpoint
    DONE = "done"


@dataclass(frozen=True, slots=True)
class RestartState:
    """Where one restart stands: what it replaces and what its last launch started."""

    decision_id: str
    world: int
    stage: Stage = Stage.BEGIN
    ranks: tuple[int, ...] = ()  # the ranks being replaced
    first: bool = True  # the next attempt starts from killing (else: launches again)
    front: int = 0  # the tick every rank must pass for the restart to count
    blocked: tuple[int, ...] = ()  # survivors found still blocked, replaced too
    launched: dict[str, Any] | None = None  # what the latest launch started
    why: str = TARGETED_OFF  # why a full-group restart, if it comes to that
    deadline: float = 0.0  # wall time by which the group must step (0: none set yet)
    # Once done: how it ended (its last effects), carried out again by a supervisor that
    # died before it resolved the decision.
    end: tuple[Effect, ...] = ()

    @property
    def live(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.ranks]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "decision_id": self.decision_id,
            "world": self.world,
            "stage": self.stage.value,
            "ranks": list(self.ranks),
            "first": self.first,
            "front": self.front,
            "blocked": list(self.blocked),
            "launched": self.launched,
            "why": self.why,
            "deadline": self.deadline,
            "end": [_end_dict(e) for e in self.end],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RestartState:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"restart state schema {data.get('schema')!r}, expected {SCHEMA}")
        return cls(
            decision_id=str(data["decision_id"]),
            world=int(data["world"]),
            stage=Stage(data["stage"]),
            ranks=tuple(int(r) for r in data["ranks"]),
            first=bool(data["first"]),
            front=int(data["front"]),
            blocked=tuple(int(r) for r in data["blocked"]),
            launched=data["launched"],
            why=str(data["why"]),
            # A record written before the deadline was kept has none: the wait starts afresh.
            deadline=float(data.get("deadline", 0.0)),
            end=tuple(_end_of(e) for e in data["end"]),
        )


# ----------------------------------------------------------------- inputs
@dataclass(frozen=True, slots=True)
class Begin:
    """The policy decided to replace `ranks`; `why` is what was lost."""

    ranks: tuple[int, ...]
    why: str


@dataclass(frozen=True, slots=True)
class Resume:
    """A restarted supervisor found this restart in its state record; `ranks`: the
    decision's ranks still in the group, with any lost since; `why`: as for `Begin`."""

    ranks: tuple[int, ...]
    why: str


@dataclass(frozen=True, slots=True)
class Killed:
    """The lost ranks' processes are killed; `front`: the survivors' newest tick before."""

    front: int


@dataclass(frozen=True, slots=True)
class Checked:
    """The survivors were checked: `blocked` are still in the broken collective,
    `stuck` still in the rendezvous of a generation that can no longer form,
    `framework` in a framework's loop, which never re-forms the group, `joined`
    were lost meanwhile (all killed by the shell); each is replaced too."""

    blocked: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    stuck: tuple[int, ...] = ()
    framework: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Launched:
    """Replacements started at wall time `at` (0: unknown); `info`: generation, source, how
    each rank was replaced."""

    info: dict[str, Any]
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class Formed:
    """After a resume: whether every rank answers from the launched generation."""

    formed: bool


@dataclass(frozen=True, slots=True)
class Stepped:
    """Every rank stepped in the new generation."""


@dataclass(frozen=True, slots=True)
class AttemptFailed:
    """The attempt in progress failed: a replacement died, the group did not step in time, ..."""

    reason: str


@dataclass(frozen=True, slots=True)
class Waited:
    """The back-off is over; `joined`: ranks lost meanwhile, replaced by the next attempt."""

    joined: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class AllRestarted:
    """The full-group restart formed a generation and every rank stepped in it."""

    info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class AllFailed:
    reason: str


RestartInput = (
    Begin
    | Resume
    | Killed
    | Checked
    | Launched
    | Formed
    | Stepped
    | AttemptFailed
    | Waited
    | AllRestarted
    | AllFailed
)


# ---------------------------------------------------------------- effects
@dataclass(frozen=True, slots=True)
class Job:
    """Move the job state machine (journaled there with its reason)."""

    input: Input


@dataclass(frozen=True, slots=True)
class Kill:
    """Kill `ranks`' current processes (their slots closed; after a failed attempt, its
    replacements); answer `Killed`."""

    ranks: tuple[int, ...]
    live: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CheckSurvivors:
    """Find survivors still blocked or stuck, and ranks lost meanwhile; kill them; answer
    `Checked`. `retry`: before launching again after a failed attempt, whose generation
    is abandoned first (its store closed: waits on it fail, a wait on a dead peer does not)."""

    live: tuple[int, ...]
    retry: bool = False


@dataclass(frozen=True, slots=True)
class Launch:
    """Start `ranks` in the next generation from rank `source`'s state, and order the
    survivors to form it; `retry`: after a failed attempt (new actors, over a new
    rendezvous store). Answer `Launched`."""

    ranks: tuple[int, ...]
    source: int
    retry: bool = False


@dataclass(frozen=True, slots=True)
class CheckFormed:
    """After a resume: does every rank answer from `generation`? Answer `Formed`."""

    generation: int


@dataclass(frozen=True, slots=True)
class AwaitSteps:
    """Wait until every rank reported a tick past `past`, at the latest until wall time
    `deadline` (0: `REGROUP_TIMEOUT_S` from now); `fresh`: no tick of this supervisor's life
    counts yet (after a resume). Answer `Stepped` or `AttemptFailed`."""

    past: int
    ranks: tuple[int, ...]
    live: tuple[int, ...]
    fresh: bool = False
    deadline: float = 0.0


@dataclass(frozen=True, slots=True)
class Backoff:
    """Pause before the next attempt (jittered, growing with `attempts`); answer `Waited`."""

    attempts: int


@dataclass(frozen=True, slots=True)
class RestartAll:
    """Kill every rank and start them all from the last committed checkpoint; answer
    `AllRestarted` or `AllFailed`."""

    cause: str


@dataclass(frozen=True, slots=True)
class KillAll:
    """Nothing is left to supervise: stop every rank."""


@dataclass(frozen=True, slots=True)
class Resolve:
    """The restart is over: its decision's outcome, detail and result (the launch's info)."""

    outcome: str  # "applied" | "failed"
    detail: str
    ranks: tuple[int, ...]
    info: dict[str, Any] | None = None


Effect = (
    Job
    | Kill
    | CheckSurvivors
    | Launch
    | CheckFormed
    | AwaitSteps
    | Backoff
    | RestartAll
    | KillAll
    | Resolve
)


# ------------------------------------------------------------- transitions
@dataclass(frozen=True, slots=True)
class _Step:
    """A step's result under way: the machine, the job as its effects leave it, and the effects."""

    state: RestartState
    job: JobState
    effects: tuple[Effect, ...] = ()

    def job_input(self, inp: Input, max_targeted: int) -> _Step:
        job, _ = transition(self.job, inp, max_targeted=max_targeted)
        return replace(self, job=job, effects=(*self.effects, Job(inp)))

    def then(self, state: RestartState, *effects: Effect) -> _Step:
        return replace(self, state=state, effects=(*self.effects, *effects))


def step(
    state: RestartState,
    job: JobState,
    inp: RestartInput,
    *,
    cause: str,
    max_targeted: int = MAX_TARGETED_ATTEMPTS,
) -> tuple[RestartState, list[Effect]]:
    """The restart's next state and the effects to carry out, in order.

    `job`: the job's state now; `cause`: the anomaly that led here (the
    steps a full-group restart redoes are lost to it).
    """
    out = _step(_Step(state, job), inp, cause, max_targeted)
    return out.state, list(out.effects)


def _step(s: _Step, inp: RestartInput, cause: str, k: int) -> _Step:
    st = s.state
    if st.stage is Stage.DONE:
        # Resumed by a supervisor that died before the decision was resolved: end it again.
        return s.then(st, *st.end) if isinstance(inp, Resume) else s
    match inp:
        case Begin(ranks, why):
            s = replace(s, state=replace(st, ranks=_union(ranks)))
            if s.job.phase not in (Phase.RUNNING, Phase.DEGRADED, *_UNDER_WAY):
                return _over(s, _not_now(s.job))
            s = s.job_input(RanksLost(frozenset(ranks), why), k)
            return _next_attempt(s, cause, k)
        case Resume(ranks, why):
            if s.job.phase in (Phase.RUNNING, Phase.DEGRADED):
                # Decided, but its supervisor died before it began.
                return _step(replace(s, state=replace(st, stage=Stage.BEGIN)), Begin(ranks, why),
                             cause, k)  # fmt: skip
            if s.job.phase not in _UNDER_WAY:  # the job is ending (a stop, an abort)
                return _over(s, _not_now(s.job))
            lost = _union(ranks, st.ranks, s.job.lost)
            st = replace(st, ranks=lost)
            if st.stage is Stage.STEP and st.launched and s.job.phase is Phase.RECOVERING:
                # The crashed supervisor's replacements may have joined: see if the group formed.
                return s.then(st, CheckFormed(int(st.launched["generation"])))
            # Anywhere else: its first attempt starts over from killing the lost ranks'
            # current processes (and any replacements the crashed one had started).
            return _next_attempt(replace(s, state=replace(st, first=True)), cause, k)
    if s.job.phase not in _UNDER_WAY:  # the job left recovery meanwhile (every rank ended)
        return _over(s, _not_now(s.job))
    match inp:
        case Killed(front):
            # The tick to pass is the one from before the loss, not a failed attempt's.
            st = replace(st, stage=Stage.CHECK, front=front if st.first else st.front)
            return s.then(st, CheckSurvivors(tuple(st.live), retry=not st.first))
        case Checked(blocked, joined, stuck, framework):
            st = replace(st, ranks=_union(st.ranks, joined), blocked=())
            if not st.live:
                return _failed(replace(s, state=st), NO_SOURCE, cause, k, final=True)
            found = ((blocked, STILL_BLOCKED), (stuck, STUCK_JOINING), (framework, FRAMEWORK_LOOP))
            for ranks, why in found:
                if ranks:
                    s = s.job_input(RanksLost(frozenset(ranks), why), k)
            if blocked or stuck or framework:
                st = replace(st, ranks=_union(st.ranks, blocked, stuck, framework),
                             blocked=_union(blocked, stuck, framework))  # fmt: skip
                if not st.live:
                    why = NONE_RECOVERED if blocked or stuck else NONE_CAN_REGROUP
                    return _failed(replace(s, state=st), why, cause, k, final=True)
            st = replace(st, stage=Stage.LAUNCH)
            return s.then(st, Launch(st.ranks, min(st.live), retry=not st.first))
        case Launched(info, at):
            launched = (
                {**info, "blocked": list(st.blocked)} if st.first or st.blocked else dict(info)
            )
            deadline = at + REGROUP_TIMEOUT_S if at else 0.0
            st = replace(st, stage=Stage.STEP, launched=launched, deadline=deadline)
            return s.then(st, AwaitSteps(st.front, st.ranks, tuple(st.live), deadline=deadline))
        case Formed(formed):
            if not formed:
                return _next_attempt(replace(s, state=replace(st, first=True)), cause, k)
            # The crashed supervisor's launch: its deadline holds (the group may be late).
            return s.then(
                st, AwaitSteps(st.front, st.ranks, tuple(st.live), fresh=True, deadline=st.deadline)
            )
        case Stepped():
            info = st.launched or {}
            s = s.job_input(Regrouped(int(info["generation"])), k)
            how = ", ".join(f"rank {r} by a {how}" for r, how in info["replacements"].items())
            if info.get("skipped_spares"):
                skipped = ", ".join(info["skipped_spares"])
                how += f" (skipped {skipped}: no answer to a ping, or not promoted; killed)"
            detail = (
                f"replaced {how}; generation {info['generation']} formed from rank "
                f"{info['source']}'s state"
            )
            return _end(s, Resolve("applied", detail, st.ranks, info))
        case AttemptFailed(reason):
            return _failed(s, reason, cause, k)
        case Waited(joined):
            if joined:  # lost since the attempt began: the next one starts over with them
                st = replace(st, ranks=_union(st.ranks, joined), first=True)
            return _next_attempt(replace(s, state=st), cause, k)
        case AllRestarted(info):
            s = s.job_input(Regrouped(int(info["generation"]), str(info["resumed"])), k)
            detail = (
                f"{st.why}; restarted every rank in generation {info['generation']} "
                f"{info['resumed']}"
            )
            return _end(s, Resolve("applied", detail, st.ranks, info))
        case AllFailed(reason):
            s = s.job_input(RestartFailed(reason), k)
            return _over(s, f"{st.why}; full-group restart failed: {reason}", kill_all=True)
    raise ValueError(f"{type(inp).__name__} in stage {st.stage}")


def _next_attempt(s: _Step, cause: str, k: int) -> _Step:
    """The next attempt, a full-group restart, or the end, by the job's phase."""
    st = s.state
    if s.job.phase is Phase.RESTARTING_ALL:
        return s.then(replace(st, stage=Stage.ALL), RestartAll(cause))
    if s.job.phase is not Phase.RECOVERING:
        return _over(s, _not_now(s.job))
    if not st.live:
        return _failed(s, NO_SOURCE, cause, k, final=True)
    # Again after a failed attempt too: its replacements are killed and the survivors
    # checked again, since one stuck in the failed generation's rendezvous would never
    # take the next order.
    return s.then(replace(st, stage=Stage.KILL), Kill(st.ranks, tuple(st.live)))


def _failed(s: _Step, reason: str, cause: str, k: int, *, final: bool = False) -> _Step:
    """An attempt failed: one failed attempt for the job; the next one launches again, after a
    pause. `final`: no survivor is left to take the state from, so the whole group restarts."""
    # Under a framework's loop no targeted restart could work: it did not fail, it was not one.
    head = "no targeted restart" if reason == NONE_CAN_REGROUP else "targeted restart failed"
    why = f"{head}: {reason}"
    s = s.job_input(RestartFailed(reason, final), k)
    st = replace(s.state, first=False, why=why)
    if s.job.phase is Phase.RECOVERING:
        return s.then(replace(st, stage=Stage.BACKOFF), Backoff(s.job.attempts))
    return _next_attempt(replace(s, state=st), cause, k)


def _over(s: _Step, detail: str, *, kill_all: bool = False) -> _Step:
    resolve = Resolve("failed", detail, s.state.ranks)
    return _end(s, KillAll(), resolve) if kill_all else _end(s, resolve)


def _union(*groups: Iterable[int]) -> tuple[int, ...]:
    """Ranks of every group, once each, in order."""
    return tuple(sorted({r for group in groups for r in group}))


def _not_now(job: JobState) -> str:
    return f"not carried on: the job is {job.phase} ({job.reason or 'no reason given'})"


def _end(s: _Step, *effects: Effect) -> _Step:
    return s.then(replace(s.state, stage=Stage.DONE, end=effects), *effects)


def _end_dict(effect: Effect) -> dict[str, Any]:
    if isinstance(effect, Resolve):
        return {"resolve": [effect.outcome, effect.detail, list(effect.ranks), effect.info]}
    return {"kill_all": True}


def _end_of(data: dict[str, Any]) -> Effect:
    if "resolve" in data:
        outcome, detail, ranks, info = data["resolve"]
        return Resolve(str(outcome), str(detail), tuple(int(r) for r in ranks), info)
    return KillAll()
