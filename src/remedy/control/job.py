"""The job's lifecycle as an explicit, pure state machine.

The supervisor actor gathers inputs (ranks started, ranks lost, a targeted
restart that worked or failed, the ranks' final results, an abort) and
feeds them to `JobStateMachine.step`, which returns the (previous, next)
states and journals the transition with one sentence of reason. Nothing
here touches Ray or torch, so every transition is tested on its own, and a
restarted supervisor could rebuild the state from the last journaled
record (`JobState.to_dict` / `from_dict`).

    starting -> running(g) -> recovering(g, lost, reason) -> running(g+1)
                   |              | K failed targeted restarts, or no survivor left
                   | K = 0        v
                   +------> restarting-all(g) -> running(g+1)   (every rank from a checkpoint)
                                  | failed again
                                  v
                               aborting -> aborted
    running(g) -> finished | aborted | failed   (when every rank has ended)
    running(g) -> degraded(g, lost, reason) -> running(g)   (a lost rank the policy did
                                                              not replace came back)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

# Targeted restarts that may fail in a row before the whole group restarts.
MAX_TARGETED_ATTEMPTS = 3


class Phase(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESTARTING_ALL = "restarting-all"
    # Ranks lost and not replaced (the policy notified, ran dry, or was suppressed):
    # the others wait on them, so the job is not running, whatever the ranks say.
    DEGRADED = "degraded"
    ABORTING = "aborting"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


ENDED = frozenset({Phase.FINISHED, Phase.ABORTED, Phase.FAILED})


@dataclass(frozen=True, slots=True)
class JobState:
    """Where the job is: its phase, the process-group generation, and what is being recovered."""

    phase: Phase = Phase.STARTING
    generation: int = 0
    lost: frozenset[int] = frozenset()
    reason: str = ""
    attempts: int = 0  # failed targeted restarts in a row

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "generation": self.generation,
            "lost": sorted(self.lost),
            "reason": self.reason,
            "attempts": self.attempts,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobState:
        return cls(
            Phase(data["phase"]),
            int(data["generation"]),
            frozenset(int(r) for r in data["lost"]),
            str(data["reason"]),
            int(data["attempts"]),
        )


# ----------------------------------------------------------------- inputs
@dataclass(frozen=True, slots=True)
class Started:
    """Every rank of the group joined generation `generation`."""

    generation: int = 0


@dataclass(frozen=True, slots=True)
class RanksLost:
    """The hang watch or Ray found these ranks hung or dead."""

    ranks: frozenset[int]
    reason: str


@dataclass(frozen=True, slots=True)
class Regrouped:
    """A restart formed generation `generation` and every rank took a step in it."""

    generation: int
    detail: str = ""  # e.g. the checkpoint a full-group restart resumed from


@dataclass(frozen=True, slots=True)
class RestartFailed:
    """The targeted (or full-group) restart in progress did not work; `final`: no targeted
    attempt can (no healthy rank is left to take the state from)."""

    reason: str
    final: bool = False


@dataclass(frozen=True, slots=True)
class RanksUnreplaced:
    """Ranks found lost that no decision is replacing; `reason` says what the policy answered."""

    ranks: frozenset[int]
    reason: str


@dataclass(frozen=True, slots=True)
class RanksBack:
    """Lost ranks that were not replaced made progress again (they were slow, not hung)."""

    ranks: frozenset[int]


@dataclass(frozen=True, slots=True)
class AbortRequested:
    reason: str


@dataclass(frozen=True, slots=True)
class RanksEnded:
    """Every rank's training function returned; `status` is the job's overall result."""

    status: str  # "completed" | "aborted" | "failed"
    reason: str = ""


Input = (
    Started
    | RanksLost
    | RanksUnreplaced
    | RanksBack
    | Regrouped
    | RestartFailed
    | AbortRequested
    | RanksEnded
)


class TransitionError(ValueError):
    """An input that makes no sense in the current phase (a supervisor bug, not a job fault)."""


def transition(
    state: JobState, inp: Input, *, max_targeted: int = MAX_TARGETED_ATTEMPTS
) -> tuple[JobState, str]:
    """The next state for `inp`, and the sentence that explains the transition."""
    if state.ended:
        raise TransitionError(f"the job has ended ({state.phase}); {type(inp).__name__} ignored")
    match inp:
        case Started(generation):
            if state.phase is not Phase.STARTING:
                raise TransitionError(f"Started in {state.phase}")
            return (
                JobState(Phase.RUNNING, generation),
                f"every rank joined generation {generation}; training",
            )
        case RanksLost(ranks, reason):
            ranks_s = _ranks(ranks)
            if state.phase is Phase.DEGRADED:
                # A restart now replaces these ranks; the unreplaced ones stay lost.
                state = replace(state, phase=Phase.RUNNING, lost=frozenset())
            if state.phase is Phase.RUNNING and max_targeted <= 0:
                return (
                    replace(
                        state, phase=Phase.RESTARTING_ALL, lost=frozenset(ranks), reason=reason
                    ),
                    (
                        f"{reason}; targeted restarts are off (max_targeted_restarts is 0): "
                        "restarting the whole group from the last checkpoint every rank committed"
                    ),
                )
            if state.phase is Phase.RUNNING:
                return (
                    replace(state, phase=Phase.RECOVERING, lost=frozenset(ranks), reason=reason),
                    f"{reason}; replacing only {ranks_s} of generation {state.generation}",
                )
            if state.phase in (Phase.RECOVERING, Phase.RESTARTING_ALL):
                lost = state.lost | ranks
                return (
                    replace(state, lost=lost, reason=reason),
                    f"{reason} during recovery; now replacing {_ranks(lost)}",
                )
            raise TransitionError(f"RanksLost in {state.phase}")
        case RanksUnreplaced(ranks, reason):
            if state.phase not in (Phase.RUNNING, Phase.DEGRADED):
                raise TransitionError(f"RanksUnreplaced in {state.phase}")
            lost = (state.lost if state.phase is Phase.DEGRADED else frozenset()) | ranks
            return (
                replace(state, phase=Phase.DEGRADED, lost=lost, reason=reason),
                f"{reason}; the other ranks wait on {_ranks(lost)}: the job is degraded",
            )
        case RanksBack(ranks):
            if state.phase is not Phase.DEGRADED:
                raise TransitionError(f"RanksBack in {state.phase}")
            lost = state.lost - ranks
            if lost:
                return (
                    replace(state, lost=lost),
                    f"{_ranks(ranks)} made progress again; still waiting on {_ranks(lost)}",
                )
            return (
                JobState(Phase.RUNNING, state.generation),
                f"{_ranks(ranks)}, lost and not replaced, made progress again; training",
            )
        case Regrouped(generation, detail):
            if state.phase not in (Phase.RECOVERING, Phase.RESTARTING_ALL):
                raise TransitionError(f"Regrouped in {state.phase}")
            if state.phase is Phase.RECOVERING:
                how = f"targeted restart of {_ranks(state.lost)}"
            else:
                how = f"full-group restart after losing {_ranks(state.lost)}"
            detail = f" ({detail})" if detail else ""
            return (
                JobState(Phase.RUNNING, generation),
                f"{how} formed generation {generation}{detail}; training",
            )
        case RestartFailed(reason, final):
            if state.phase is Phase.RECOVERING:
                attempts = state.attempts + 1
                if attempts < max_targeted and not final:
                    return (
                        replace(state, attempts=attempts, reason=reason),
                        (
                            f"targeted restart {attempts} of {max_targeted} failed ({reason}); "
                            "trying again"
                        ),
                    )
                why = (
                    f"a targeted restart cannot work ({reason})"
                    if final
                    else f"targeted restart failed {attempts} times ({reason})"
                )
                return (
                    replace(state, phase=Phase.RESTARTING_ALL, attempts=attempts, reason=reason),
                    (
                        f"{why}; restarting the whole group from the last checkpoint every rank "
                        "committed"
                    ),
                )
            if state.phase is Phase.RESTARTING_ALL:
                return (
                    replace(state, phase=Phase.ABORTING, reason=reason),
                    f"full-group restart failed ({reason}); aborting the run",
                )
            raise TransitionError(f"RestartFailed in {state.phase}")
        case AbortRequested(reason):
            return replace(state, phase=Phase.ABORTING, reason=reason), f"aborting: {reason}"
        case RanksEnded(status, reason):
            if state.phase is Phase.ABORTING or status == "aborted":
                phase = Phase.ABORTED
            elif status == "completed" and state.phase in (Phase.RUNNING, Phase.DEGRADED):
                # Degraded: the lost ranks came back before the watch saw it; all completed.
                phase = Phase.FINISHED
            else:
                phase = Phase.FAILED
            why = reason or f"every rank ended ({status})"
            return replace(state, phase=phase, reason=why), why
    raise TransitionError(f"unknown input {inp!r}")


def _ranks(ranks: frozenset[int]) -> str:
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


@dataclass
class JobStateMachine:
    """The current `JobState`; `step` moves it and journals each transition: the record
    goes into `history` and into `moves`, what the shell is yet to journal (a history line
    and a state record: `take_moves`)."""

    max_targeted: int = MAX_TARGETED_ATTEMPTS
    state: JobState = field(default_factory=JobState)
    history: list[dict[str, Any]] = field(default_factory=list)
    moves: list[dict[str, Any]] = field(default_factory=list)

    def step(self, inp: Input) -> tuple[JobState, JobState]:
        """Apply one input; return (previous, next)."""
        previous = self.state
        self.state, reason = transition(previous, inp, max_targeted=self.max_targeted)
        record = {
            "type": "job_state",
            "input": type(inp).__name__,
            "from": previous.to_dict(),
            "to": self.state.to_dict(),
            "reason": reason,
        }
        self.history.append(record)
        self.moves.append(record)
        return previous, self.state

    def take_moves(self) -> list[dict[str, Any]]:
        """The transitions since the last call, for the shell to journal (then forgotten)."""
        out, self.moves = self.moves, []
        return out
