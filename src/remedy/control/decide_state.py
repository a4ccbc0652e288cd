"""The Controller's state record, and rebuilding a Controller from the journal.

`journal.wal` is the source of truth of a supervised run, and from state
schema 8 on it holds nothing but the supervisor's state (`record.RunRecord`,
full records and deltas). Its `controller` section is `dump`'s: the
engine's state (counters, cooldowns, budget, the decision sequence number),
the pending commands with their targets and the outcomes received, the ids
already closed, each rank's step and tick, and the counters of the summary.
The supervisor writes one whenever what it has promised changed (before the
reply that carries a new command goes out) and every few seconds.

A restarted supervisor loads the last one (`load`). A decision taken after
it was never dispatched (no reply carried it: the record is written before
the reply), so it is abandoned, and the rank's batch that caused it, re-sent
because it was never answered, is decided again, under an id of the new
incarnation (`abandoned` names them from the history); a resolution after
it is redone when the outcome it came with is re-sent.

Journals of state schema 7 and older also held the run's history
(`decided`, `resolved`, `job_state`, `ranks_ended`, `run_ended`, ...):
`older_tail` and `replay_tail` read what a restore needs of it. Nothing
here touches Ray.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from remedy.control import record as run_state
from remedy.policies import AnomalyEvent, Decision
from remedy.protocol.commands import Command, Outcome
from remedy.protocol.reports import RankMark

if TYPE_CHECKING:
    from remedy.control.command_book import Outcomes
    from remedy.control.decide import Controller

FORMAT = 1
STATE = "state"
# Closed decision ids a state record keeps (the newest): 1,000 ids are ~20 kB.
MAX_CLOSED_KEPT = 1000
# A pending command's targets when they are every rank of the world.
ALL = "all"
# The rank whose recent losses a state record keeps (`Controller.final_loss`'s default).
LOSS_RANK = 0


def dump(c: Controller) -> dict[str, Any]:
    """The JSON-able state of `c` (everything `load` needs to carry on)."""
    return {
        "format": FORMAT,
        "engine": c.engine.state_dict(),
        "seq": c._seq,
        "pending": [
            {
                "decision": p.decision.to_dict(),
                "command": p.command.to_dict(),
                # Every rank, for almost every command: one word instead of world_size numbers.
                # Targets are every rank less those lost since (`drop_rank`): a full count is
                # all of them, told without building a set of the world for each record.
                "targets": ALL if len(p.targets) == c.world_size else sorted(p.targets),
                "outcomes": _grouped(p.outcomes),
                "dropped": sorted(p.dropped),
                "dispatched_at": p.dispatched_at,
            }
            for p in c.pending.values()
        ],
        "closed": list(c._recent_closed),
        "deferred": [d.to_dict() for d in c.deferred.values()],
        "step_of": dict(c.rows.step_of),
        "tick_of": dict(c.rows.tick_of),
        # Only the lead rank's: `final_loss()` (what `status` shows) reads no other, and ten
        # floats of every rank were 40% of a record at 4,096 ranks.
        "recent_loss": {str(r): list(v) for r, v in c.recent_loss.items() if r == LOSS_RANK},
        "marks": dict(c.rows.marks),
        "anomaly_counts": dict(c.anomaly_counts),
        "action_counts": dict(c.action_counts),
        "outcome_counts": dict(c.outcome_counts),
        "rejected": dict(c.rejected),
        "abort_reason": c.abort_reason,
        "stop_reason": c.stop_reason,
        "incidents": c.incidents.state(),
    }


def load(c: Controller, data: dict[str, Any]) -> None:
    """Put `c` (freshly built, same policy) in the state `dump` recorded."""
    from remedy.control.command_book import Outcomes, Pending  # noqa: PLC0415 - it imports this

    if data.get("format") != FORMAT:
        raise ValueError(f"not a controller state of format {FORMAT}")
    c.engine.load_state_dict(data["engine"])
    c._seq = int(data["seq"])
    c.pending = {}
    for raw in data["pending"]:
        decision = _decision(raw["decision"])
        pending = Pending(
            decision,
            Command.from_dict(raw["command"]),
            set(range(c.world_size)) if raw["targets"] == ALL else {int(r) for r in raw["targets"]},
            float(raw["dispatched_at"]),
            outcomes=Outcomes((o.rank, o) for o in _ungrouped(raw["outcomes"])),
            dropped={int(r) for r in raw["dropped"]},
        )
        c.pending[pending.command.decision_id] = pending
    c._recent_closed.clear()
    c._recent_closed.extend(str(i) for i in data["closed"])
    c._closed = set(c._recent_closed)
    c.deferred = {}
    for raw in data["deferred"]:
        d = _decision(raw)
        c.deferred[d.decision_id] = d
    c.step_of = _unkeyed(data["step_of"])
    c.tick_of = _unkeyed(data["tick_of"])
    c.recent_loss = {
        int(r): deque((float(x) for x in v), maxlen=10) for r, v in data["recent_loss"].items()
    }
    c._marks = {
        int(r): RankMark(int(m[0]), int(m[1]), float(m[2])) for r, m in data["marks"].items()
    }
    c.rows = RankRows.of(c.step_of, c.tick_of, c._marks)
    c.anomaly_counts = Counter(data["anomaly_counts"])
    c.action_counts = Counter(data["action_counts"])
    c.outcome_counts = Counter(data["outcome_counts"])
    c.rejected = Counter(data["rejected"])
    c.abort_reason = data["abort_reason"]
    c.stop_reason = data.get("stop_reason")
    # Events held for the other ranks' reports of their tick (records before the merge had none).
    c.incidents.restore(data.get("incidents"), now=c.now)


class RankRows:
    """Each rank's step, tick and progress mark as a state record writes them, kept as they
    change (`took`): a record copies these maps instead of building 4,096 entries of each,
    and an entry left unchanged is the same object in the next record, which
    `run_state.StateLog` then skips by identity (no entry is changed once given)."""

    def __init__(self) -> None:
        self.step_of: dict[str, int] = {}
        self.tick_of: dict[str, int] = {}
        # Tuples (written as JSON lists): hashable, so `StateLog` diffs the map in C.
        self.marks: dict[str, tuple[int, int, float]] = {}

    def took(self, rank: int, step_of: int, mark: RankMark) -> None:
        """Rank `rank`'s newest accepted report: its highest step so far and its mark."""
        key = str(rank)
        if self.step_of.get(key) != step_of:
            self.step_of[key] = step_of
        if self.tick_of.get(key) != mark.tick:
            self.tick_of[key] = mark.tick
        self.marks[key] = (mark.step, mark.tick, mark.at)

    @classmethod
    def of(
        cls, step_of: dict[int, int], tick_of: dict[int, int], marks: dict[int, RankMark]
    ) -> RankRows:
        rows = cls()
        rows.step_of = _keyed(step_of)
        rows.tick_of = _keyed(tick_of)
        rows.marks = {str(r): (m.step, m.tick, m.at) for r, m in marks.items()}
        return rows


def _grouped(outcomes: Outcomes) -> list[dict[str, Any]]:
    """A pending command's outcomes as `Outcomes` keeps them grouped: one entry per group, its
    ranks as `ranks_mask`, the hex digits of their bit mask (4,096 ranks in 1,024 characters)."""
    return [{**fields, "ranks_mask": format(mask, "x")} for fields, mask in outcomes.grouped()]


def _ungrouped(entries: Iterable[dict[str, Any]]) -> list[Outcome]:
    """The outcomes of `_grouped` entries, and of older records' (`ranks` lists, or one
    entry per outcome)."""
    out = []
    for entry in entries:
        if "ranks_mask" in entry:
            ranks = _bits(int(entry["ranks_mask"], 16))
        elif "ranks" in entry:
            ranks = [int(r) for r in entry["ranks"]]
        else:
            out.append(Outcome.from_dict(entry))
            continue
        fields = {k: v for k, v in entry.items() if k not in ("ranks", "ranks_mask")}
        out.extend(Outcome.from_dict({**fields, "rank": r}) for r in ranks)
    return out


def _bits(mask: int) -> list[int]:
    """The positions of the set bits of `mask`, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _decision(raw: dict[str, Any]) -> Decision:
    """A decision of a state record, an operator's stop included.

    `Controller.stop` makes its decision from an `operator_stop` event, which is
    no anomaly kind of the policy vocabulary, so `AnomalyEvent.from_dict`
    refuses it: a supervisor restarted during a stop could not load its state.
    """
    anomaly = raw.get("anomaly")
    if not (isinstance(anomaly, dict) and anomaly.get("source") == "operator"):
        return Decision.from_dict(raw)
    names = {f.name for f in dataclasses.fields(AnomalyEvent)}
    event = AnomalyEvent(**{k: v for k, v in anomaly.items() if k in names})
    checked = {**anomaly, "kind": "rank_dead", "source": "supervisor"}  # the rest is checked
    return dataclasses.replace(Decision.from_dict({**raw, "anomaly": checked}), anomaly=event)


@dataclasses.dataclass(frozen=True, slots=True)
class OlderTail:
    """What a journal of state schema 7 or older held besides its state records and a
    restarted supervisor needs: how many supervisors started, whether the ranks or the run
    had ended, and the job state moves after the last state record. Empty for a journal of
    schema 8 on, whose state records hold all of it."""

    lives: int = 0
    ranks_ended: dict[str, Any] | None = None
    ended: str | None = None
    job: dict[str, Any] | None = None


def older_tail(journal: list[dict[str, Any]], tail: list[dict[str, Any]]) -> OlderTail:
    """`OlderTail` of `journal` (all its records) and `tail` (those after its last state)."""
    lives = sum(1 for r in journal if r.get("type") == "supervisor_started")
    ranks_ended = next((r.get("results") for r in reversed(journal)
                        if r.get("type") == "ranks_ended"), None)  # fmt: skip
    ended = next((r.get("status") for r in reversed(journal) if r.get("type") == "run_ended"), None)
    job = next((r["to"] for r in reversed(tail)
                if r.get("type") == "job_state" and isinstance(r.get("to"), dict)), None)  # fmt: skip
    return OlderTail(
        lives=lives,
        ranks_ended=ranks_ended if isinstance(ranks_ended, dict) else None,
        ended=None if ended is None else str(ended),
        job=job,
    )


def replay_tail(c: Controller, tail: list[dict[str, Any]]) -> list[str]:
    """The `decided` records after the last state record of a journal of schema 7 or older;
    returns the abandoned decision ids.

    A `decided` decision is abandoned (it went to no rank; its cause will be
    decided again) but its number is never reused. A `resolved` one changes
    nothing: its outcome is re-sent. Records of other types are the
    supervisor's (job state, policy) and skipped here.
    """
    abandoned: list[str] = []
    for record in tail:
        if record.get("type") != "decided":
            continue
        decision = record.get("decision")
        if not isinstance(decision, dict):
            continue
        decision_id = str(decision.get("decision_id"))
        number = _number(decision_id)
        if number is not None:
            c.engine.advance_seq(number)
        command = record.get("command")
        if isinstance(command, dict) and isinstance(command.get("seq"), int):
            c._seq = max(c._seq, command["seq"])
        if decision_id not in c.pending and decision_id not in c._closed:
            abandoned.append(decision_id)
    return abandoned


def abandoned(c: Controller, history: Iterable[dict[str, Any]]) -> list[str]:
    """The decisions of `history` (the run's `history.jsonl`) that the restored `c` neither
    holds (pending, deferred) nor has closed or journaled: taken after the last state record,
    so never dispatched. Each was taken under an earlier supervisor's incarnation, whose
    decision ids this one's never reuse."""
    out = []
    for record in history:
        decision = record.get("decision") if record.get("type") == "decided" else None
        if not isinstance(decision, dict):
            continue
        decision_id = str(decision.get("decision_id"))
        if not (decision_id in c.pending or decision_id in c.deferred
                or decision_id in c._closed or decision_id in c._journaled):  # fmt: skip
            out.append(decision_id)
    return out


def split_at_last_state(records: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[Any]]:
    """(the newest state, or None: the last `state` record with the `state_delta` records after
    it applied (`run_state.fold`); the records after the last of them)."""
    return run_state.fold(records)


def _number(decision_id: str) -> int | None:
    """The sequence number at the end of `RUN-dNNNNN` / `RUN-sK-dNNNNN`."""
    head, sep, digits = decision_id.rpartition("-d")
    return int(digits) if sep and head and digits.isdigit() else None


def _keyed(d: dict[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in d.items()}


def _unkeyed(d: dict[str, Any]) -> dict[int, int]:
    return {int(k): int(v) for k, v in d.items()}
