"""Crash after any journal write of a rollback, an operator stop or a group restart: nothing lost or repeated.

The writes are the state records of journal.wal (the shell's: `RunState`, a full record
then deltas, as the supervisor writes them with `StateLog`) and the history lines (the
Controller's, `decided` and `resolved`); a restored supervisor reads journal.wal (folded
to its newest `RunState`) and decisions.jsonl only."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from remedy.control import decide_state as control_state
from remedy.control.job import JobState, Phase
from remedy.control.record import RunState, StateLog
from remedy.control.slots import RankSlots
from remedy.policies import AnomalyEvent, Decision, Engine, load_policy_text
from remedy.rundir.journals import read_journal
from remedy.rundir.writer import RunDir, read_jsonl
from tests.supervisor.core.carried import Carried

POLICY = """
version: 1
name: restore-table
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 10, skip_batches: 0}
      - shrink_lr: {factor: 0.5}
  - name: rank-restart
    when: {anomaly: rank_dead}
    do: [restart_rank]
"""
WORLD = 2
STEPS = 12


@dataclass
class Rank:
    """A rank as the Controller sees it: it applies each command once, at its next step, and says so."""

    rank: int
    applied: Counter[str] = field(default_factory=Counter)
    owed: list[dict[str, Any]] = field(default_factory=list)  # outcomes for the next batch

    def take(self, commands: list[dict[str, Any]], step: int) -> None:
        for cmd in commands:
            decision_id = cmd["decision_id"]
            if not self.applied[decision_id]:
                self.applied[decision_id] += 1
            # A command sent again after it was applied is answered again, not re-applied.
            outcome = {"decision_id": decision_id, "rank": self.rank, "outcome": "applied"}
            if outcome not in [{k: o[k] for k in outcome} for o in self.owed]:
                self.owed.append({**outcome, "step": step, "tick": step})


class Shell:
    """What the supervisor actor does around its Controller: a state record before each reply."""

    def __init__(self, run_dir: Path, incarnation: int) -> None:
        self.run_dir = run_dir
        self.files = RunDir(run_dir, "r")
        self.restarts: list[str] = []  # group actions handed to "the worker group"
        engine = Engine(load_policy_text(POLICY, "t.yaml"), run_id="r", incarnation=incarnation)
        self.c = Carried(
            engine,
            world_size=WORLD,
            files=self.files,
            group_action=self._group,
        )
        self._changes = -1
        self.incarnation = incarnation
        self.log = StateLog()  # a new supervisor's first record is a full one

    def _group(self, d: Decision) -> None:
        self.restarts.append(d.decision_id)  # carried out later, asynchronously

    def keep_state(self) -> None:
        if self.c.changes != self._changes:
            slots = RankSlots(WORLD)
            state = RunState(
                incarnation=self.incarnation, started=0.0, job=JobState(Phase.RUNNING, 0),
                slots=slots.state_records(), last_seq=slots.seqs(), group=None,
                controller=json.loads(json.dumps(self.c.state_dict(), default=str)),
            )  # fmt: skip
            self.files.wal(self.log.entry(state.to_record()))
            self._changes = self.c.changes

    @classmethod
    def restored(cls, run_dir: Path, incarnation: int) -> Shell:
        """A new supervisor from the journal: its last state record, then decisions.jsonl."""
        shell = cls(run_dir, incarnation)
        journal = read_journal(run_dir / "journal.wal")
        state, tail = control_state.split_at_last_state(journal)
        assert tail == [], "journal.wal holds state records only"
        if state is not None:
            run = RunState.from_record(state)
            assert run.incarnation == incarnation - 1
            shell.c.load_state_dict(run.controller)
        shell.c.restore_decisions(read_jsonl(run_dir / "decisions.jsonl"))
        shell.restarts = list(shell.c.deferred)
        return shell


def _nan(step: int) -> dict[str, Any]:
    return AnomalyEvent("nonfinite_loss", 0, step, tick=step, severity="critical").to_dict()


def _dead(step: int) -> dict[str, Any]:
    event = AnomalyEvent("rank_dead", 1, step, tick=step, severity="critical", source="supervisor")
    return event.to_dict()


# A flow: the events a rank's batch carries at a step (it may act on the shell first).
Flow = Callable[[Shell, int, int], list[dict[str, Any]]]


def _rollback(shell: Shell, step: int, rank: int) -> list[dict[str, Any]]:
    return [_nan(step)] if (step, rank) == (3, 0) else []


def _stop(shell: Shell, step: int, rank: int) -> list[dict[str, Any]]:
    if step == 3 and shell.c.stop_reason is None:
        shell.c.stop("an operator's stop")
        shell.keep_state()
    return []


def _restart(shell: Shell, step: int, rank: int) -> list[dict[str, Any]]:
    if step == 6:  # the worker group finished the restart: resolve it
        for decision_id in list(shell.restarts):
            if decision_id in shell.c.deferred:
                shell.c.resolve_group_action(decision_id, "applied", "replaced rank 1")
                shell.keep_state()
    # As the supervisor's hang watch reports it: in the lost rank's name.
    return [_dead(step)] if (step, rank) == (3, 1) else []


def _run(tmp: Path, flow: Flow, crash_at: int | None) -> tuple[Shell, list[Rank], int]:
    """Run STEPS steps of WORLD ranks; the supervisor dies after its `crash_at`-th journal write."""
    shell = Shell(tmp, 1)
    ranks = [Rank(r) for r in range(WORLD)]
    writes = crashes = 0
    for step in range(STEPS):
        for rank in ranks:
            events = flow(shell, step, rank.rank)
            batch = {
                "rank": rank.rank, "step": step, "tick": step, "events": events,
                "metrics": [], "outcomes": rank.owed,
            }  # fmt: skip
            rank.owed = []
            replies = shell.c.ingest(batch)
            shell.keep_state()  # before the reply leaves
            rank.take(replies, step)
            now = len(read_journal(tmp / "journal.wal")) + len(read_journal(tmp / "history.jsonl"))
            if crash_at is not None and writes < crash_at <= now and not crashes:
                crashes += 1
                shell = Shell.restored(tmp, 2)
            writes = now
    return shell, ranks, writes


FLOWS = {"rollback": _rollback, "operator stop": _stop, "group restart": _restart}


def _journal_writes(tmp: Path, flow: Flow) -> int:
    _, _, writes = _run(tmp, flow, None)
    return writes


@pytest.mark.parametrize("name", list(FLOWS))
@pytest.mark.timeout(120)
def test_a_crash_after_any_journal_write_loses_and_repeats_nothing(
    tmp_path: Path, name: str
) -> None:
    """For every journal write of the flow: crash there, restore, carry on; the same decisions, once each."""
    flow = FLOWS[name]
    writes = _journal_writes(tmp_path / "clean", flow)
    clean = read_jsonl(tmp_path / "clean" / "decisions.jsonl")
    expected = sorted((d["action"], d["outcome"]) for d in clean)
    assert expected, "the flow decided nothing"
    assert writes > 0, "the flow wrote no journal record"
    for crash_at in range(1, writes + 1):
        tmp = tmp_path / f"crash{crash_at}"
        shell, ranks, _ = _run(tmp, flow, crash_at)
        decisions = read_jsonl(tmp / "decisions.jsonl")
        ids = [d["decision_id"] for d in decisions]
        assert len(ids) == len(set(ids)), (crash_at, ids)
        assert sorted((d["action"], d["outcome"]) for d in decisions) == expected, crash_at
        assert not shell.c.pending and not shell.c.deferred, crash_at
        for rank in ranks:  # every command reached every rank and was applied once there
            assert set(rank.applied.values()) <= {1}, (crash_at, rank.applied)
