"""The book of pending commands: what each rank is owed, and the outcomes that close it.

A decision the ranks carry out becomes a command given out to every rank
(`dispatch`; an abort's or an operator's stop adds a `-stop` command,
`dispatch_stop`). Each rank owes it until it reports its outcome
(`owed`); the decision resolves once every target has answered, or one
failed (`take_outcome`, `resolve`): it is journaled, the engine's
follow-ups go back to the Controller, and a failed step drops the rest of
its chain. A closed command's late outcomes are late, not invalid
(`close`). A pending command's outcomes are kept grouped (`Outcomes`), which
is what a state record writes. The state is the Controller's (`pending`,
`_closed`, `_recent_closed`, `_seq`); these functions are its only writers
besides a restore (`decide_state.load`).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from remedy.control import replay_answer
from remedy.control.decision_journal import journal
from remedy.control.effects import HistoryRecord
from remedy.control.goodput import REWINDING_ACTIONS
from remedy.policies import Decision
from remedy.protocol.commands import Command, Outcome

if TYPE_CHECKING:
    from remedy.control.decide import Controller

# Commands the controller adds beside the decisions: an operator's or a policy's stop of
# every rank's loop, and the answer to a replay the ranks hold for (`replay_answer`).
INTERNAL_SUFFIXES = ("-stop", "-answer")


def internal(decision_id: str) -> bool:
    """Whether `decision_id` names one of the Controller's own commands, not a decision's."""
    return decision_id.endswith(INTERNAL_SUFFIXES)


class Outcomes(dict[int, Outcome]):
    """A pending command's outcomes by rank, kept grouped as they come (`grouped`).

    A command goes to every rank and its outcomes mostly say the same: the
    outcomes that differ only in their rank form one group, whose ranks are
    a bit mask. A state record writes the groups (`decide_state.dump`); at
    4,096 ranks grouping every pending command's outcomes anew for each
    record was a third of the supervisor's event loop.
    """

    def __init__(self, items: Iterable[tuple[int, Outcome]] = ()) -> None:
        super().__init__()
        # group key -> [the outcome's fields but its rank, the ranks' bit mask, the key]
        self._groups: dict[tuple[Any, ...], list[Any]] = {}
        # rank -> its group's key: the group's own key object, so that an outcome keeps no
        # key of its own (4,096 ranks' outcomes of each pending command would otherwise keep
        # two tuples each, which the supervisor's garbage collector walked: 2/3 of the
        # objects its young generation held at 4,096 ranks, `supervisor_load.py --agents`).
        self._key_of: dict[int, tuple[Any, ...]] = {}
        for rank, outcome in items:
            self[rank] = outcome

    def __setitem__(self, rank: int, outcome: Outcome) -> None:
        if rank in self:
            self._ungroup(rank)
        super().__setitem__(rank, outcome)
        key = outcome_key(outcome)
        group = self._groups.get(key)
        if group is None:
            fields = outcome.to_dict()
            del fields["rank"]
            group = self._groups[key] = [fields, 0, key]
        group[1] |= 1 << rank
        self._key_of[rank] = group[2]

    def __delitem__(self, rank: int) -> None:
        super().__delitem__(rank)
        self._ungroup(rank)

    def pop(self, rank: int, *default: Any) -> Any:
        if rank in self:
            self._ungroup(rank)
        return super().pop(rank, *default)

    def clear(self) -> None:
        super().clear()
        self._groups.clear()
        self._key_of.clear()

    def _ungroup(self, rank: int) -> None:
        key = self._key_of.pop(rank)
        group = self._groups[key]
        group[1] &= ~(1 << rank)
        if not group[1]:
            del self._groups[key]

    def grouped(self) -> list[tuple[dict[str, Any], int]]:
        """(an outcome's fields but its rank, the bit mask of the ranks that reported it)."""
        return [(fields, mask) for fields, mask, _ in self._groups.values()]

    # Every other way to change a dict would bypass the groups.
    def update(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Outcomes: set outcomes one by one")

    def setdefault(self, rank: int, default: Outcome) -> Outcome:
        raise TypeError("Outcomes: set outcomes one by one")

    def popitem(self) -> tuple[int, Outcome]:
        raise TypeError("Outcomes: pop an outcome by its rank")


# An outcome's fields but its rank and result, as a tuple: what outcomes grouped together share.
_OUTCOME_FIELDS = operator.attrgetter(
    *(f.name for f in dataclasses.fields(Outcome) if f.name not in ("rank", "result"))
)


def outcome_key(o: Outcome) -> tuple[Any, ...]:
    """What outcomes that differ only in their rank share (the result as JSON, if any)."""
    return (
        _OUTCOME_FIELDS(o),
        json.dumps(o.result, sort_keys=True, default=str) if o.result else "",
    )


@dataclass
class Pending:
    """A command given out for a decision, with the ranks it awaits and their outcomes."""

    decision: Decision
    command: Command
    targets: set[int]
    dispatched_at: float
    outcomes: Outcomes = field(default_factory=Outcomes)
    # Lost ranks no longer awaited: their replacements still receive the
    # command (and apply it unless the adopted state has it done already).
    dropped: set[int] = field(default_factory=set)
    # The command as it goes out, built once: every report of every target gets it
    # until that rank answers (asdict deep-copies on each call).
    wire: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.wire = self.command.to_dict()


def owed(c: Controller, ranks: Iterable[int]) -> dict[int, list[dict[str, Any]]]:
    """The commands each of `ranks` still owes, for one reply: each command is copied once
    and the ranks owing it share that copy (its receiver takes one per rank:
    `AgentCore.commands`)."""
    copies: dict[str, dict[str, Any]] = {}
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in ranks:
        owed = out[rank] = []
        for decision_id, p in c.pending.items():
            if (rank in p.targets and rank not in p.outcomes) or rank in p.dropped:
                wire = copies.get(decision_id)
                if wire is None:
                    wire = copies[decision_id] = {**p.wire, "params": dict(p.wire["params"])}
                owed.append(wire)
    return out


def dispatch(c: Controller, d: Decision) -> None:
    """Give out decision `d`'s command to every rank, from the step after the furthest one."""
    apply_at = max(c.step_of.values(), default=0) + c.command_lead
    c._seq += 1
    command = Command.from_decision(
        d,
        apply_at_step=apply_at,
        apply_at_tick=c._tick() + c.command_lead,
        seq=c._seq,
    )
    targets = set(range(c.world_size))
    if (
        d.action in REWINDING_ACTIONS
    ):  # the ranks' next rewind is this one's: its steps are lost to it
        c.goodput.expect_rewind(c.now, d.anomaly.kind)
    c._emit(
        HistoryRecord({"type": "decided", "decision": d.to_dict(), "command": command.to_dict()})
    )
    c.pending[d.decision_id] = Pending(d, command, targets, c.now)


def dispatch_stop(c: Controller, d: Decision) -> None:
    """Stop every rank's loop at its next boundary: the `<decision>-stop` command of `d`."""
    apply_at = max(c.step_of.values(), default=0)
    c._seq += 1
    cmd = Command(
        d.decision_id + "-stop",
        "abort",
        dict(d.params),
        apply_at,
        d.anomaly.step,
        apply_at_tick=c._tick(),
        seq=c._seq,
    )
    c.pending[cmd.decision_id] = Pending(d, cmd, set(range(c.world_size)), c.now)


def close(c: Controller, decision_id: str) -> None:
    """Take a command off the pending list; outcomes still on their way are then late, not invalid."""
    del c.pending[decision_id]
    c._closed.add(decision_id)
    c._recent_closed.append(decision_id)
    c.changes += 1


def take_outcome(c: Controller, outcome: Outcome) -> None:
    """A rank's outcome of a pending command; the decision resolves once every target answered
    (or one failed)."""
    pending = c.pending.get(outcome.decision_id)
    if pending is None or outcome.rank not in pending.targets:
        # A rank may still report a step of a chain that was dropped, or a
        # command resolved without it; an id never issued is bad input.
        if outcome.decision_id not in c._closed:
            c.rejected["outcome_unknown_decision"] += 1
        return
    # An outcome alone moves no state record (at 256 ranks that was one per
    # outcome): lost in a crash, it is asked for again, as the restored
    # command is still owed by that rank, which re-sends a done command's
    # outcome. Closing the command does (`_close`).
    pending.outcomes[outcome.rank] = outcome
    # Outcomes come only from targets (checked above), so every target has answered
    # when there are as many: no pass over every rank per outcome (at 4,096 ranks a
    # command's outcomes cost O(ranks^2) that way).
    complete = len(pending.outcomes) >= len(pending.targets)
    if internal(pending.command.decision_id):
        if complete:
            close(c, outcome.decision_id)
        return
    failed = (
        [o for o in pending.outcomes.values() if o.outcome != "applied"]
        if complete or outcome.outcome != "applied"
        else []
    )
    if failed or complete:
        resolve(c, pending, failed)


def resolve(c: Controller, pending: Pending, failed: list[Outcome]) -> None:
    """Close `pending` as applied (or failed, `failed` naming the outcomes that did), journal
    it, and hand the engine's follow-ups back to the Controller."""
    close(c, pending.decision.decision_id)
    d = pending.decision
    first = next(iter(failed), None) or pending.outcomes[min(pending.outcomes)]
    outcome = "failed" if failed else "applied"
    c._emit(HistoryRecord({"type": "resolved", "decision_id": d.decision_id, "outcome": outcome}))
    follow = c.engine.record_outcome(d.decision_id, outcome, tick=c._tick(), detail=first.detail)
    journal_outcome = "escalated" if failed and follow else outcome
    journal(
        c,
        d,
        journal_outcome,
        detail=first.detail,
        result=first.result,
        applied_at_step=first.step,
        apply_at_step=pending.command.apply_at_step,
        latency_s=round(c.now - pending.dispatched_at, 4),
        attempts=first.attempts,
    )
    if failed and d.ends_chain_on_failure:
        drop_rest_of_chain(c, d)
    c.handle(follow)
    if d.action == "replay_step" and not failed:
        # The ranks hold for the answer to their replay (`replay_answer`).
        cmd = replay_answer.answer(c, d, first)
        c.pending[cmd.decision_id] = Pending(d, cmd, set(pending.targets), c.now)
        c.changes += 1


def drop_rest_of_chain(c: Controller, failed: Decision) -> None:
    """A failed step ends its chain: later steps are not carried out (the engine says so too)."""
    for pending in list(c.pending.values()):
        later = pending.decision
        if later.chain_id == failed.chain_id and later.chain_index > failed.chain_index:
            close(c, later.decision_id)
            step = failed.chain_index + 1
            journal(c, later, "suppressed", detail=f"not run: step {step} of the chain failed")
