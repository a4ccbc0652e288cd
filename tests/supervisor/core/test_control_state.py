"""A Controller rebuilt from its journal's last state record and tail carries on as if it never stopped."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from remedy.control import decide_state as control_state
from remedy.control.decide import Controller, Outcomes
from remedy.policies import AnomalyEvent, Engine, load_policy_text
from remedy.protocol.commands import Outcome
from remedy.rundir.journals import read_journal
from remedy.rundir.writer import RunDir, read_jsonl
from tests.supervisor.core.carried import Carried

POLICY = """
version: 1
name: state-test
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 10, skip_batches: 0}
      - shrink_lr: {factor: 0.5}
    cooldown: 50
  - name: told
    when: {anomaly: data_stall}
    do: [notify]
"""


def _controller(run_dir: Path, incarnation: int = 1) -> Controller:
    engine = Engine(load_policy_text(POLICY, "state.yaml"), run_id="r", incarnation=incarnation)
    c = Carried(engine, world_size=2, files=RunDir(run_dir, "r"))
    # Not a test of merging one incident across ranks (tests/policies/test_incidents.py,
    # test_restore_table.py): an incident is decided on its first report.
    c.incidents.hold_s = 0.0
    return c


def _batch(rank: int, step: int, *events: dict[str, Any], outcomes: Any = ()) -> dict[str, Any]:
    return {
        "rank": rank,
        "step": step,
        "tick": step,
        "events": list(events),
        "metrics": [{"step": step, "rank": rank, "loss": 1.0 / (step + 1), "step_time_s": 0.01}],
        "outcomes": list(outcomes),
    }


def _nan(rank: int, step: int) -> dict[str, Any]:
    return AnomalyEvent(
        "nonfinite_loss", rank, step, tick=step, value=float("nan"), severity="critical"
    ).to_dict()


def _applied(decision_id: str, rank: int, step: int) -> dict[str, Any]:
    return {
        "decision_id": decision_id,
        "rank": rank,
        "outcome": "applied",
        "step": step,
        "tick": step,
    }


def _roundtrip(c: Controller) -> dict[str, Any]:
    """The state record as it is read back from journal.wal (JSON)."""
    out: dict[str, Any] = json.loads(json.dumps(c.state_dict(), default=str))
    return out


def _restored(tmp: Path, state: dict[str, Any], incarnation: int = 2) -> Controller:
    c = _controller(tmp, incarnation)
    c.load_state_dict(state)
    return c


def test_record_then_restore_gives_the_same_state(tmp_path: Path) -> None:
    """A state record restored into a fresh Controller dumps to the same record, pending rollback included."""
    c = _controller(tmp_path / "a")
    for step in range(5):
        c.ingest(_batch(0, step))
        c.ingest(_batch(1, step))
    commands = c.ingest(_batch(0, 5, _nan(0, 5)))
    assert [cmd["action"] for cmd in commands] == ["rollback", "shrink_lr"]
    rollback = commands[0]["decision_id"]
    c.ingest(_batch(0, 6, outcomes=[_applied(rollback, 0, 6)]))
    record = _roundtrip(c)
    again = _restored(tmp_path / "b", record)
    assert _roundtrip(again) == record
    assert again.pending[rollback].outcomes.keys() == {0}
    assert again.step_of == c.step_of and again.tick_of == c.tick_of
    assert again.final_loss() == c.final_loss()


def test_restored_controller_decides_like_the_original(tmp_path: Path) -> None:
    """After a restore, the rest of the stream resolves the same decisions and keeps the cooldown."""
    original = _controller(tmp_path / "a")
    commands = original.ingest(_batch(0, 5, _nan(0, 5)))
    ids = [cmd["decision_id"] for cmd in commands]
    record = _roundtrip(original)
    restored = _restored(tmp_path / "b", record)
    rest = [
        _batch(1, 6, outcomes=[_applied(i, 1, 6) for i in ids]),
        _batch(0, 6, outcomes=[_applied(i, 0, 6) for i in ids]),
        _batch(0, 10, _nan(0, 10)),  # within the cooldown: suppressed, not a second rollback
    ]
    for c in (original, restored):
        for batch in rest:
            c.ingest(batch)
    assert not original.pending and not restored.pending
    seen = [
        [(d["action"], d["outcome"], d["anomaly"]["step"]) for d in c.decisions]
        for c in (original, restored)
    ]
    assert seen[0] == seen[1]
    assert ("rollback", "applied", 5) in seen[0]
    assert [d["outcome"] for d in original.decisions].count("suppressed") == 1
    assert restored.action_counts == original.action_counts


def test_decision_after_the_last_state_record_is_abandoned_and_decided_anew(
    tmp_path: Path,
) -> None:
    """A decision after the last state record went to no rank (a reply waits for the record):
    the history names it abandoned, and the re-sent batch decides anew under this
    incarnation's ids."""
    c = _controller(tmp_path)
    c.ingest(_batch(0, 1))
    RunDir(tmp_path, "r").wal({"type": control_state.STATE, "controller": c.state_dict()})
    lost = c.ingest(_batch(0, 5, _nan(0, 5)))  # decided, then the supervisor died before replying
    lost_ids = {cmd["decision_id"] for cmd in lost}
    state, tail = control_state.split_at_last_state(read_journal(tmp_path / "journal.wal"))
    assert state is not None and tail == []  # journal.wal holds state records only
    restored = _restored(tmp_path, state["controller"])
    restored.restore_decisions(read_jsonl(tmp_path / "decisions.jsonl"))
    history = read_jsonl(tmp_path / "history.jsonl")
    assert set(control_state.abandoned(restored, history)) == lost_ids
    again = restored.ingest(_batch(0, 5, _nan(0, 5)))  # the unanswered batch, re-sent
    assert [cmd["action"] for cmd in again] == ["rollback", "shrink_lr"]
    new_ids = {cmd["decision_id"] for cmd in again}
    assert not new_ids & lost_ids
    assert all("-s2-" in i for i in new_ids)
    # The new decisions, pending, are not abandoned ones.
    now = read_jsonl(tmp_path / "history.jsonl")
    assert set(control_state.abandoned(restored, now)) == lost_ids


def test_a_schema_7_journals_decided_tail_is_abandoned_and_its_number_never_reused(
    tmp_path: Path,
) -> None:
    """A journal of state schema 7 held the `decided` records too: one in the tail went to no
    rank, so it is abandoned; the re-sent batch decides anew under a new id and number."""
    c = _controller(tmp_path)
    c.ingest(_batch(0, 1))
    state_record = {"type": control_state.STATE, "controller": c.state_dict()}
    lost = c.ingest(_batch(0, 5, _nan(0, 5)))  # decided, then the supervisor died before replying
    lost_ids = {cmd["decision_id"] for cmd in lost}
    decided = [r for r in read_jsonl(tmp_path / "history.jsonl") if r["type"] == "decided"]
    older = tmp_path / "older.wal"
    older.write_text("".join(json.dumps(r, default=str) + "\n" for r in [state_record, *decided]))
    state, tail = control_state.split_at_last_state(read_journal(older))
    assert state is not None and [r["type"] for r in tail] == ["decided", "decided"]
    restored = _restored(tmp_path, state["controller"])
    assert set(control_state.replay_tail(restored, tail)) == lost_ids
    again = restored.ingest(_batch(0, 5, _nan(0, 5)))  # the unanswered batch, re-sent
    assert [cmd["action"] for cmd in again] == ["rollback", "shrink_lr"]
    new_ids = {cmd["decision_id"] for cmd in again}
    assert not new_ids & lost_ids
    assert restored.engine.seq == c.engine.seq + 2
    assert max(cmd["seq"] for cmd in again) > max(cmd["seq"] for cmd in lost)


def test_outcome_resent_after_restart_is_not_journaled_twice(tmp_path: Path) -> None:
    """An outcome resolved just before the crash, re-sent after it: one decisions.jsonl line, counts kept."""
    c = _controller(tmp_path)
    ids = [cmd["decision_id"] for cmd in c.ingest(_batch(0, 5, _nan(0, 5)))]
    state = _roundtrip(c)  # the last state record: both ranks still owe their outcomes
    c.ingest(_batch(1, 6, outcomes=[_applied(i, 1, 6) for i in ids]))
    c.ingest(_batch(0, 6, outcomes=[_applied(i, 0, 6) for i in ids]))
    assert not c.pending
    restored = _restored(tmp_path, state)
    restored.restore_decisions(read_jsonl(tmp_path / "decisions.jsonl"))
    assert set(restored.pending) == set(ids)
    restored.ingest(_batch(1, 6, outcomes=[_applied(i, 1, 6) for i in ids]))
    restored.ingest(_batch(0, 6, outcomes=[_applied(i, 0, 6) for i in ids]))
    assert not restored.pending
    lines = read_jsonl(tmp_path / "decisions.jsonl")
    assert sorted(d["decision_id"] for d in lines) == sorted(ids)
    assert restored.action_counts == {"rollback": 1, "shrink_lr": 1}
    assert restored.commands_for(0) == [] and restored.commands_for(1) == []


def test_torn_last_journal_line_is_skipped(tmp_path: Path) -> None:
    """A crash mid-write leaves half a line: the reader skips it and finds the state record before it."""
    c = _controller(tmp_path)
    c.ingest(_batch(0, 1))
    RunDir(tmp_path, "r").wal({"type": control_state.STATE, "controller": c.state_dict()})
    with open(tmp_path / "journal.wal", "a", encoding="utf-8") as fh:
        fh.write('{"type": "state_delta", "se')
    state, tail = control_state.split_at_last_state(read_journal(tmp_path / "journal.wal"))
    assert state is not None and tail == []


def test_outcomes_differing_only_in_rank_are_kept_as_one_entry() -> None:
    """A state record groups a command's like outcomes, and loading gives every one back."""

    def outcome(rank: int, detail: str = "") -> Outcome:
        return Outcome(decision_id="d1", rank=rank, outcome="applied", step=3, tick=3,
                       detail=detail)  # fmt: skip

    outcomes = [outcome(r) for r in range(6)] + [outcome(6, "late"), outcome(4097, "late")]
    entries = control_state._grouped(Outcomes((o.rank, o) for o in outcomes))
    assert sorted(e["ranks_mask"] for e in entries) == sorted(
        ["3f", format((1 << 6) | (1 << 4097), "x")]
    )
    assert sorted(control_state._ungrouped(entries), key=lambda o: o.rank) == outcomes
    # Records written before: the ranks as a list, or one outcome per entry.
    fields = {k: v for k, v in entries[0].items() if k != "ranks_mask"}
    assert [o.rank for o in control_state._ungrouped([{**fields, "ranks": [1, 2]}])] == [1, 2]
    assert control_state._ungrouped([o.to_dict() for o in outcomes]) == outcomes


def test_outcomes_keep_their_groups_through_every_change() -> None:
    """An outcome replaced, popped or deleted leaves its group; an emptied group goes, and a
    way of changing a dict that would bypass the groups is refused."""
    outs = Outcomes()
    outs[0] = Outcome("d1", 0, "applied", 6, 6)
    outs[3] = Outcome("d1", 3, "applied", 6, 6)
    outs[2] = Outcome("d1", 2, "failed", 6, 6, "boom")
    assert sorted(mask for _, mask in outs.grouped()) == [0b100, 0b1001]
    outs[2] = Outcome("d1", 2, "applied", 6, 6)  # its rank's outcome again, now applied
    assert [mask for _, mask in outs.grouped()] == [0b1101]
    outs.pop(0)
    del outs[3]
    assert [mask for _, mask in outs.grouped()] == [0b100]
    assert outs.pop(9, None) is None and len(outs) == 1
    outs.clear()
    assert outs.grouped() == [] and not outs
    with pytest.raises(TypeError):
        outs.update({1: Outcome("d1", 1, "applied", 6, 6)})


def test_an_outcome_as_a_dict_has_every_field_and_copies_its_result() -> None:
    """`Outcome.to_dict`, written out by hand, says what `dataclasses.asdict` would."""
    result = {"files": ["a", "b"], "bytes": 3}
    outcome = Outcome("r-d00001", 2, "applied", 5, 6, "ok", result, attempts=2)
    assert outcome.to_dict() == dataclasses.asdict(outcome)
    outcome.to_dict()["result"]["files"].append("c")
    assert result == {"files": ["a", "b"], "bytes": 3}
    assert Outcome.from_dict(outcome.to_dict()) == outcome


def test_a_state_record_holds_a_commands_outcomes_after_each_change(tmp_path: Path) -> None:
    """The groups a record writes follow every change of the outcomes (taken, dropped,
    cleared), and a record read back has them all."""
    c = _controller(tmp_path)
    [first, _] = [cmd["decision_id"] for cmd in c.ingest(_batch(0, 5, _nan(0, 5)))]

    def masks() -> list[str]:
        [entry] = [p for p in c.state_dict()["pending"] if p["command"]["decision_id"] == first]
        return [o["ranks_mask"] for o in entry["outcomes"]]

    assert masks() == []
    c.ingest(_batch(1, 6, outcomes=[_applied(first, 1, 6)]))
    assert masks() == ["2"]
    pending = c.pending[first]
    pending.outcomes.pop(1)  # the rank was lost before the others answered
    assert masks() == []
    pending.outcomes[1] = Outcome(first, 1, "applied", 6, 6)
    pending.outcomes[0] = Outcome(first, 0, "applied", 6, 6)
    assert masks() == ["3"]
    restored = _restored(tmp_path, _roundtrip(c))
    assert set(restored.pending[first].outcomes) == {0, 1}
    pending.outcomes.clear()
    assert masks() == []


def test_a_record_gives_each_unchanged_rank_entry_again_and_a_changed_one_anew(
    tmp_path: Path,
) -> None:
    """Step, tick and mark of a rank that did not report since the last record are the same
    objects in the next one (`StateLog` skips them by identity); a record given out never
    changes, and a restored controller writes the same maps."""
    c = _controller(tmp_path)
    c.ingest(_batch(0, 1))
    c.ingest(_batch(1, 1))
    first = c.state_dict()
    c.ingest(_batch(1, 2))
    second = c.state_dict()
    for key in ("step_of", "tick_of", "marks"):
        assert second[key]["0"] is first[key]["0"]
        assert second[key]["1"] != first[key]["1"]
    assert first["marks"]["1"][0] == 1 and second["marks"]["1"][0] == 2
    restored = _restored(tmp_path, _roundtrip(c))
    again = restored.state_dict()
    assert {k: again[k] for k in ("step_of", "tick_of", "marks")} == {
        k: second[k] for k in ("step_of", "tick_of", "marks")
    }
