"""The escalation ladder: a restart loop is bounded, whatever policy runs it.

A remedy that rewinds the run (a rollback, a rank restart) runs the steps
after its restore point again; a fault tied to one of those steps (a bad
sample at a fixed position, a poisoned step, a rank that dies there) then
comes back, and the policy's rule would answer it the same way for as long
as its `max_fires` allows, or for ever. The ladder takes over such an
incident: the same anomaly kind at the same step, seen again after a rewind
the policy chose for it. Each rung is a stronger remedy:

0. the policy's own remedy (its rule's chain: usually a rollback to an
   in-memory snapshot);
1. a rollback to the newest durable checkpoint before the incident;
2. a rollback to an older durable checkpoint (one before that);
3. a rollback that skips a range of batches past the incident's step;
4. stop and page: a notification and an abort, with the reason.

The incident seen `repeats` times (3) on one rung climbs to the next: a rung
is tried `repeats - 1` times. On rung 0 the rule itself answers each
sighting, under its own cooldown and budget (a sighting it holds back still
counts); from rung 1 the ladder answers, the rule's limits no longer apply. A rung whose action fails (no durable
checkpoint under a framework's callbacks, none old enough) climbs at once.
For an incident whose remedy restarted a rank, rungs 1-3 restart it again
before the rollback. The last rung comes once; later sightings are ignored.

Pure: the engine feeds it sightings and outcomes and emits what it says
(`Engine._ladder_step`), so it holds under `remedy run`, the callbacks and a
lone Guard alike. Its state is plain JSON (`to_dict` / `from_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from remedy.policies._events import AnomalyEvent
from remedy.policies._rules import Step, freeze

# The remedies that run steps again, so that a fault tied to a step comes back.
LADDER_ACTIONS: Final = frozenset({"rollback", "restart_rank"})
# Kinds that belong to one rank: two ranks lost at one step are two incidents, and the
# same rank lost there again is the same one. Other kinds are one incident per step,
# whichever rank reported it (one fault seen through a collective is merged already).
RANK_KINDS: Final = frozenset({"rank_hang", "rank_dead", "node_lost", "replica_divergence"})
# Sightings of one incident on one rung before it climbs (the standalone rollback
# chain of the default policy allows 3 fires too, then aborts).
REPEATS: Final = 3
# Incidents remembered; the oldest are forgotten first (one per kind and step).
MAX_INCIDENTS: Final = 256
# The rollback a rung builds on when the policy's chain has none (a rank restart).
DEFAULT_STEPS_BACK: Final = 30
DEFAULT_SKIP: Final = 10


@dataclass(frozen=True, slots=True)
class Rung:
    """One rung: its name and what it does, in words."""

    name: str
    text: str


RUNGS: Final[tuple[Rung, ...]] = (
    Rung("policy", "the policy's own remedy"),
    Rung("durable", "roll back to the newest durable checkpoint before the incident"),
    Rung("older", "roll back to an older durable checkpoint (the one before that)"),
    Rung("skip", "roll back and skip a range of batches past the incident's step"),
    Rung("stop", "stop the run and page a person"),
)
STOP: Final = len(RUNGS) - 1


@dataclass
class Incident:
    """One incident the ladder tracks: a kind at a step, its rung and sightings on it."""

    kind: str
    step: int
    rule: str  # the rule whose rewind started it (its name goes on every rung's decisions)
    rank: int = -1  # the rank, for a kind of `RANK_KINDS`
    rung: int = 0
    seen: int = 1  # sightings on this rung, the first included
    sightings: int = 1  # sightings in all
    tick: int = 0  # the executed step of the last sighting
    chain: str = ""  # the chain issued for the last sighting
    awaiting: bool = True  # that chain's rewind has no outcome yet
    steps_back: int = DEFAULT_STEPS_BACK
    skip: int = DEFAULT_SKIP
    restart: bool = False  # the policy's remedy restarted a rank

    @property
    def name(self) -> str:
        """``nonfinite_loss at step 60``, ``rank_dead at step 50 on rank 2``."""
        where = f" on rank {self.rank}" if self.rank >= 0 else ""
        return f"{self.kind} at step {self.step}{where}"


@dataclass(frozen=True, slots=True)
class Move:
    """What the ladder says about one sighting or one failed rung.

    `act`: False when there is nothing to do (a sighting of the rewind still
    under way, or one after the last rung); else `rung` is the rung to apply,
    `climbed` whether it is new for this incident, and `why` the sentence.
    """

    incident: Incident
    act: bool
    rung: int
    climbed: bool
    why: str

    def details(self) -> dict[str, Any]:
        """What the anomaly of the rung's decisions carries (`details["ladder"]`)."""
        inc = self.incident
        return {
            "incident": inc.name,
            "rung": self.rung,
            "rungs": STOP,
            "name": RUNGS[self.rung].name,
            "seen": inc.seen,
            "sightings": inc.sightings,
            "climbed": self.climbed,
        }


@dataclass
class Ladder:
    """The incidents remedied by a rewind, and the rung each stands on."""

    repeats: int = REPEATS
    incidents: dict[tuple[str, int, int], Incident] = field(default_factory=dict)

    def remedied(
        self, event: AnomalyEvent, *, tick: int, rule: str, chain: str, steps: Sequence[Step]
    ) -> Incident | None:
        """A rule answered `event` with `steps` (as chain `chain`): a new incident when the
        chain rewinds the run (the one tracked already, if the rule answered a sighting of
        it on rung 0), else None."""
        actions = [s.action for s in steps]
        if not LADDER_ACTIONS.intersection(actions):
            return None
        known = self.incidents.get(_key(event))
        if known is not None:  # the rule's remedy again, on rung 0: the count goes on
            self.issued(known, chain)
            return known
        back = next((s for s in steps if s.action == "rollback"), None)
        inc = Incident(
            event.kind,
            event.step,
            rule,
            _rank(event),
            tick=tick,
            chain=chain,
            restart="restart_rank" in actions,
        )
        if back is not None:
            inc.steps_back = int(back.params.get("steps_back", DEFAULT_STEPS_BACK))
            inc.skip = int(back.params.get("skip_batches", DEFAULT_SKIP))
        key = _key(event)
        self.incidents.pop(key, None)
        self.incidents[key] = inc
        while len(self.incidents) > MAX_INCIDENTS:
            del self.incidents[next(iter(self.incidents))]
        return inc

    def sighting(self, event: AnomalyEvent, *, tick: int) -> Move | None:
        """`event` seen: None when it is no incident the ladder tracks (the policy decides);
        else the move. A sighting while the last rung's rewind is under way, at no later
        executed step, is that same sighting again (another rank's report of it)."""
        inc = self.incidents.get(_key(event))
        if inc is None:
            return None
        if inc.awaiting and tick <= inc.tick:
            return Move(inc, False, inc.rung, False, "the rewind for it is still under way")
        if inc.rung == STOP:
            return Move(inc, False, inc.rung, False, "the ladder stopped the run already")
        inc.tick = tick
        inc.sightings += 1
        inc.seen += 1
        before = inc.rung
        if inc.seen >= self.repeats:
            return self._climb(
                inc, f"seen {inc.seen} times on rung {before} ({RUNGS[before].name})"
            )
        why = (
            f"the same incident came back after rung {before} ({RUNGS[before].name}): seen "
            f"{inc.seen} of {self.repeats} times on it; applying it again"
        )
        return Move(inc, True, inc.rung, False, why)

    def issued(self, incident: Incident, chain: str) -> None:
        """The move's steps went out as chain `chain`."""
        incident.chain = chain
        incident.awaiting = True

    def resolved(self, chain: str, action: str, outcome: str, detail: str) -> Move | None:
        """A step of `chain` ended with `outcome`. A rewind's outcome ends the wait for it;
        a failed rung (above the policy's own) climbs at once: the returned move."""
        if action not in LADDER_ACTIONS:
            return None
        inc = next((i for i in self.incidents.values() if i.chain == chain), None)
        if inc is None:
            return None
        inc.awaiting = False
        if outcome != "failed" or inc.rung == 0 or inc.rung == STOP:
            return None
        because = f"rung {inc.rung} ({RUNGS[inc.rung].name}) failed" + (
            f": {detail}" if detail else ""
        )
        return self._climb(inc, because)

    def _climb(self, inc: Incident, because: str) -> Move:
        inc.rung = min(inc.rung + 1, STOP)
        inc.seen = 1
        why = f"{because}; climbing to rung {inc.rung} of {STOP}: {RUNGS[inc.rung].text}"
        return Move(inc, True, inc.rung, True, why)

    # -------------------------------------------------------------- state
    def to_dict(self) -> dict[str, Any]:
        """JSON-able state."""
        return {"repeats": self.repeats, "incidents": [asdict(i) for i in self.incidents.values()]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Ladder:
        """The ladder `to_dict` gave (an empty one for None: a state from before the ladder)."""
        if not data:
            return cls()
        ladder = cls(repeats=int(data.get("repeats", REPEATS)))
        for raw in data.get("incidents", ()):
            inc = Incident(**raw)
            ladder.incidents[(inc.kind, inc.step, inc.rank)] = inc
        return ladder


def _rank(event: AnomalyEvent) -> int:
    return event.rank if event.kind in RANK_KINDS else -1


def _key(event: AnomalyEvent) -> tuple[str, int, int]:
    """One incident: its kind, its step, and its rank for a kind of one rank."""
    return (event.kind, event.step, _rank(event))


def rung_steps(incident: Incident, rung: int, own: Sequence[Step] | None) -> tuple[Step, ...]:
    """The chain of `rung` for `incident`; `own`: the policy's chain (rung 0), None when its
    rule is gone (a reloaded policy): rung 0 then behaves as rung 1."""
    if rung == 0 and own:
        return tuple(own)
    if rung == STOP:
        text = (
            f"{incident.name} came back after every rung of the escalation ladder "
            f"({incident.sightings} sightings); stopping the run"
        )
        return (Step("notify", freeze({"message": text})), Step("abort", freeze({"reason": text})))
    back = incident.steps_back
    params: dict[str, Any] = {"steps_back": back, "skip_batches": incident.skip}
    if rung in (0, 1):
        params["source"] = "disk"
    elif rung == 2:
        params.update(source="disk", older=1)
    else:
        # Every batch from the restore point to the incident, as many again past it, and
        # the policy's own skip: the replay meets none of the batches that led there.
        params["skip_batches"] = 2 * back + incident.skip
    steps = [Step("rollback", freeze(params))]
    if incident.restart:
        steps.insert(0, Step("restart_rank", freeze({})))
    return tuple(steps)
