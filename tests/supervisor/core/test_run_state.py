"""The versioned state record: round trips, an older remedy's record is migrated and resumed, a newer one refused."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from remedy.control import restart
from remedy.control.decide import Controller
from remedy.control.job import JobState, Phase
from remedy.control.record import (
    DELTA,
    FULL_EVERY,
    SCHEMA,
    STATE,
    RunState,
    StateLog,
    StateSchemaError,
    _changed,
    fold,
    migrate,
)
from remedy.control.restart import RestartState, Stage
from remedy.control.slots import RankSlots
from remedy.policies import Engine, load_policy

# A `state` line of journal.wal written by remedy at 08a4111 (schema 1): a 2-rank run of
# tests/supervisor/daemon_train.py with a NaN at step 30, taken while its rollback and
# LR cuts were pending.
OLD = Path(__file__).parent / "data" / "state_08a4111.json"


@pytest.mark.timeout(30)
def test_a_record_of_08a4111_is_migrated_and_a_controller_resumes_from_it() -> None:
    """Schema 1 -> 2 (no restart in progress); the Controller of today loads its commands and engine."""
    record = json.loads(OLD.read_text())
    assert "schema" not in record
    run = RunState.from_record(record)
    assert "schema" not in record  # the record read is left as it was
    assert run.recovery is None
    assert run.job == JobState(Phase.RUNNING, 0)
    assert [s["incarnation"] for s in run.slots] == [1, 1]
    assert run.group is not None and run.group["generation"] == 0
    engine = Engine(load_policy("default"), run_id=record["run_id"])
    controller = Controller(engine, world_size=2)
    controller.load_state_dict(run.controller)
    pending = controller.pending.values()
    assert sorted(p.command.action for p in pending) == ["rollback", "shrink_lr", "shrink_lr"]
    assert all(p.targets == {0, 1} for p in pending)
    # Written again, it is today's schema, and reads back the same.
    again = run.to_record()
    assert again["schema"] == SCHEMA
    assert RunState.from_record(again) == run


LAUNCHED = {"generation": 1, "source": 0, "replacements": {"3": "warm spare"}, "blocked": []}


@pytest.mark.timeout(30)
def test_a_record_of_today_round_trips() -> None:
    """A RunState with a restart in progress comes back equal from its record."""
    run = RunState(
        incarnation=2,
        started=1.5,
        job=JobState(Phase.RECOVERING, 1, frozenset({3}), "rank_hang on rank 3", 1),
        slots=[{"rank": 3, "incarnation": 2, "state": "starting", "gaps": []}],
        group={"generation": 1, "names": {}, "spares": [], "next_spare": 1},
        controller={"format": 1},
        recovery={
            "restart": RestartState(
                "d1", 4, Stage.STEP, (3,), front=19, launched=LAUNCHED
            ).to_dict(),
            "marks": {},
            "detected_at": {"3": 1.0},
            "records": [],
        },
        crashed=("restart_rank:killed",),
        last_seq={"3": 0},
    )
    assert RunState.from_record(json.loads(json.dumps(run.to_record()))) == run


@pytest.mark.parametrize(
    ("record", "words"),
    [
        ({"type": "state", "schema": SCHEMA + 1}, "written by a newer remedy"),
        ({"type": "state", "schema": "2"}, "not one remedy wrote"),
        ({"type": "decided"}, "not a state record"),
    ],
)
@pytest.mark.timeout(30)
def test_records_it_cannot_read_are_refused_with_a_sentence(
    record: dict[str, object], words: str
) -> None:
    """A newer schema, a malformed one or another record type: StateSchemaError that says which."""
    with pytest.raises(StateSchemaError, match=words):
        migrate(record)


def _record(world: int, rng: random.Random, prev: dict[str, Any] | None) -> dict[str, Any]:
    """A state record like the supervisor's: each call moves a few ranks and sometimes the rest."""
    if prev is None:
        slots = [{"rank": r, "incarnation": 1, "state": "running", "gaps": [],
                  "pid": 100 + r, "node": f"n{r % 3}"} for r in range(world)]  # fmt: skip
        controller: dict[str, Any] = {
            "format": 1, "seq": 0, "pending": [], "abort_reason": None,
            "step_of": {str(r): 0 for r in range(world)},
            "tick_of": {str(r): 0 for r in range(world)},
            "marks": {str(r): [0, 0, 0.0] for r in range(world)},
        }  # fmt: skip
        record = RunState(
            incarnation=1, started=1.0, job=JobState(Phase.RUNNING, 0), slots=slots,
            group=None, controller=controller, last_seq={str(r): 0 for r in range(world)},
        ).to_record()  # fmt: skip
        return json.loads(json.dumps(record))
    record = json.loads(json.dumps(prev))  # fresh objects, as each write builds them
    for r in rng.sample(range(world), k=rng.randint(0, 3)):
        record["last_seq"][str(r)] += 1
        record["controller"]["step_of"][str(r)] += 1
        record["controller"]["marks"][str(r)] = [rng.randint(0, 9), 1, rng.random()]
    roll = rng.random()
    if roll < 0.1:
        record["controller"]["seq"] += 1
        record["controller"]["pending"].append({"decision": f"d{record['controller']['seq']}"})
    elif roll < 0.15:
        record["group"] = None if record["group"] else {"generation": 1, "names": {"0": "a"}}
    elif roll < 0.2 and record["group"]:
        record["group"]["names"][str(rng.randrange(world))] = f"x{rng.random()}"
    elif roll < 0.25:
        record["recovery"] = None if record["recovery"] else {"front": 3, "marks": {}}
    elif roll < 0.3:  # a key of the controller comes and goes
        if record["controller"].pop("abort_reason", "gone") == "gone":
            record["controller"]["abort_reason"] = "x"
    elif roll < 0.32:
        for r in record["last_seq"]:  # every rank moves: a full record is cheaper than the delta
            record["last_seq"][r] += 1
    elif roll < 0.34:  # a slot's record keeps its keys: patched
        record["slots"][rng.randrange(world)]["pid"] = rng.randint(1, 9)
    elif roll < 0.36:  # a slot's record gains or loses a key: written whole, not patched
        slot = record["slots"][rng.randrange(world)]
        if slot.pop("pid", "gone") == "gone":
            slot["pid"] = rng.randint(1, 9)
    return record


@pytest.mark.timeout(60)
def test_deltas_fold_back_to_every_record_written() -> None:
    """After each record, the journal so far folds back to it exactly; what follows is the tail."""
    rng = random.Random(7)
    log, journal, record = StateLog(), [], None
    kinds = []
    for i in range(400):
        record = _record(16, rng, record)
        entry = json.loads(json.dumps(log.entry(record)))
        kinds.append(entry["type"])
        journal.append(entry)
        journal.append({"type": "decided", "i": i})
        state, tail = fold(journal)
        assert state == record, i
        assert tail == [{"type": "decided", "i": i}]
    assert kinds[0] == STATE and kinds.count(DELTA) > 300
    # No more than FULL_EVERY deltas follow a full record.
    runs = "".join("f" if k == STATE else "d" for k in kinds).split("f")
    assert max(len(r) for r in runs) <= FULL_EVERY


@pytest.mark.timeout(60)
def test_a_full_record_put_off_by_a_reply_is_written_next_and_every_record_folds_back() -> None:
    """Records written before a reply (`defer_full`) are deltas even past the bounds, which
    leaves a full record due; the next record written without it is that full record. The
    journal folds back to every record either way."""
    rng = random.Random(11)
    log, journal, record = StateLog(), [], None
    deferred_past_bound = 0
    for i in range(400):
        record = _record(16, rng, record)
        # The group's per-rank map stays: a map that comes or goes needs a full record anyway.
        record["group"] = record["group"] or {"generation": 1, "names": {"0": "a"}}
        before_reply = rng.random() < 0.8
        was_due = log.full_due
        entry = json.loads(json.dumps(log.entry(record, defer_full=before_reply)))
        if i > 0 and before_reply:
            assert entry["type"] == DELTA, i  # a reply never waits for a full record
            deferred_past_bound += log.full_due
        if was_due and not before_reply:
            assert entry["type"] == STATE and not log.full_due, i
        journal.append(entry)
        state, _ = fold(journal)
        assert state == record, i
    assert deferred_past_bound > 0  # the bounds were reached while replies were waiting


@pytest.mark.timeout(60)
def test_a_delta_holds_only_what_changed() -> None:
    """4,096 ranks, ten of them moved: the delta is a small fraction of the full record."""
    rng = random.Random(1)
    first = _record(4096, rng, None)
    log = StateLog()
    assert log.entry(first) is first
    second = json.loads(json.dumps(first))
    for r in range(10):
        second["controller"]["tick_of"][str(r)] = 5
        second["last_seq"][str(r)] = 3
    second["slots"][7]["state"] = "lost"
    delta = log.entry(second)
    assert delta["type"] == DELTA and delta["set"] == {}
    assert sorted(delta["ranks"]) == ["controller.tick_of", "last_seq"]
    assert delta["ranks"]["last_seq"] == {str(r): 3 for r in range(10)}
    # A slot record that kept its keys is patched: only the fields that changed (keyed by
    # the rank as a number in memory, a string as journal.wal holds it).
    assert json.loads(json.dumps(delta))["patch"] == {"slots": {"7": {"state": "lost"}}}
    assert fold([json.loads(json.dumps(first)), json.loads(json.dumps(delta))])[0] == second
    assert len(json.dumps(delta)) * 100 < len(json.dumps(first))


def test_the_changed_entries_are_found_whether_the_maps_keep_their_order_or_not() -> None:
    """`_changed` pairs the two maps' values in order when they hold the same ranks in the
    same order, else looks each up: both give what a lookup per entry gives (None for a
    rank gone), for entries kept as the same object, set again to an equal value,
    changed, added or removed, and for values that are numbers, slot records (dicts) or
    lists."""

    def reference(entries: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
        diff = {r: v for r, v in entries.items() if r not in last or last[r] != v}
        return diff | {r: None for r in last if r not in entries}

    rng = random.Random(5)
    for case in range(300):
        last: dict[str, Any] = {}
        for r in range(rng.randrange(0, 40)):
            kind = rng.randrange(3)
            last[str(r)] = (10**6 + rng.randrange(5) if kind == 0 else
                            {"rank": r, "state": rng.choice("ab")} if kind == 1 else
                            [r, rng.randrange(3)])  # fmt: skip
        entries = dict(last)
        for r in list(entries):
            roll = rng.random()
            if roll < 0.1:  # set again to an equal value: not the same object
                entries[r] = json.loads(json.dumps(entries[r]))
            elif roll < 0.2:
                entries[r] = {"rank": int(r), "state": "c"}
            elif roll < 0.25:
                del entries[r]
        if rng.random() < 0.3:
            entries[str(100 + case)] = 1
        if rng.random() < 0.2:  # the same ranks in another order
            keys = list(entries)
            rng.shuffle(keys)
            entries = {k: entries[k] for k in keys}
        assert _changed(entries, last) == reference(entries, last), case


@pytest.mark.timeout(30)
def test_a_record_of_schema_2_is_read_as_today() -> None:
    """Schema 2's full record without a restart in progress is today's: only the number changes."""
    run = RunState(
        incarnation=1, started=1.0, job=JobState(Phase.RUNNING, 0), slots=[], group=None,
        controller={"format": 1},
    )  # fmt: skip
    old = {**run.to_record(), "schema": 2}
    assert migrate(old)["schema"] == SCHEMA == 8
    assert RunState.from_record(old) == run


@pytest.mark.timeout(30)
def test_a_schema_3_restart_in_progress_becomes_the_machine_at_its_step_stage() -> None:
    """Schema 3 kept a restart's launch and front: today's record holds the restart machine
    waiting for the group to step, which a restarted supervisor resumes by checking the launch."""
    run = RunState(
        incarnation=1, started=1.0, job=JobState(Phase.RECOVERING, 0, frozenset({3}), "hang", 0),
        slots=[{"rank": r} for r in range(4)], group=None, controller={"format": 1},
    )  # fmt: skip
    old = {**run.to_record(), "schema": 3}
    old["recovery"] = {"front": 19, "launched": LAUNCHED, "marks": {"restart": 1.0},
                       "detected_at": {"3": 1.0}, "joining": {}, "records": []}  # fmt: skip
    recovery = RunState.from_record(old).recovery
    assert recovery is not None and "front" not in recovery and "launched" not in recovery
    machine = RestartState.from_dict(recovery["restart"])
    assert machine == RestartState("", 4, Stage.STEP, (3,), front=19, launched=LAUNCHED)
    _, effects = restart.step(machine, run.job, restart.Resume((3,), "hang"), cause="rank_hang")
    assert effects == [restart.CheckFormed(1)]
    # Without a launch, a schema-3 restart started over from killing: no machine state.
    old["recovery"] = {"front": 0, "marks": {}, "detected_at": {}, "records": []}
    assert RunState.from_record(old).recovery == {
        "restart": None,
        "marks": {},
        "detected_at": {},
        "records": [],
    }


@pytest.mark.timeout(30)
def test_schema_5_slot_records_give_up_their_last_seq_and_their_patched_deltas_fold() -> None:
    """Schema 5 kept each slot's last_seq in its record, and its deltas patched it there: the
    folded journal reads as today's record, the numbers apart, and the slots come back whole."""
    slots = [{"rank": r, "incarnation": 1, "state": "running", "last_seq": 4, "gaps": [],
              "pid": 100 + r, "node": None} for r in range(3)]  # fmt: skip
    full = {**RunState(
        incarnation=1, started=1.0, job=JobState(Phase.RUNNING, 0), slots=slots, group=None,
        controller={"format": 1},
    ).to_record(), "schema": 5}  # fmt: skip
    del full["last_seq"]
    delta = {"type": DELTA, "schema": 5, "n": 1, "set": {}, "ranks": {},
             "patch": {"slots": {"1": {"last_seq": 9}}}}  # fmt: skip
    state, _ = fold([full, delta])
    assert state is not None
    run = RunState.from_record(state)
    assert run.last_seq == {"0": 4, "1": 9, "2": 4}
    assert all("last_seq" not in s for s in run.slots)
    again = RankSlots.from_records(run.slots, run.last_seq)
    assert [again.slots[r].last_seq for r in range(3)] == [4, 9, 4]
    assert again.records() == [{**s, "last_seq": 9 if s["rank"] == 1 else 4} for s in slots]


@pytest.mark.timeout(30)
def test_a_schema_6_record_has_no_hang_watch_state_and_todays_keeps_it() -> None:
    """Schema 6 had no `hang`: read as empty (the ranks get the start-up allowance, as then).
    Today's record keeps the hang watch's entries, per rank in the deltas."""
    run = RunState(
        incarnation=1, started=1.0, job=JobState(Phase.RUNNING, 0), slots=[], group=None,
        controller={"format": 1}, hang={"0": [0.12, 3], "1": [0.2, 3]},
    )  # fmt: skip
    old = {**run.to_record(), "schema": 6}
    del old["hang"]
    assert RunState.from_record(old).hang == {}
    log = StateLog()
    first = log.entry(run.to_record())
    delta = log.entry(replace(run, hang={**run.hang, "1": [0.25, 3]}).to_record())
    assert delta["type"] == DELTA and delta["ranks"] == {"hang": {"1": [0.25, 3]}}
    state, _ = fold([first, delta])
    assert state is not None and RunState.from_record(state).hang["1"] == [0.25, 3]


@pytest.mark.timeout(30)
def test_a_schema_7_record_has_no_end_and_todays_keeps_the_ranks_results_and_the_runs_end() -> None:
    """Schema 7 kept where the run had got to in history records of the journal (read by
    `control_state.older_tail`): its record reads with neither. Today's record holds the
    ranks' results once they have ended and the run's status once it has, and a delta
    carries each when it comes."""
    run = RunState(
        incarnation=2, started=1.0, job=JobState(Phase.RUNNING, 0), slots=[], group=None,
        controller={"format": 1},
    )  # fmt: skip
    old = {**run.to_record(), "schema": 7}
    del old["ranks_ended"], old["ended"]
    assert migrate(old)["schema"] == 8
    assert RunState.from_record(old) == run
    log = StateLog()
    first = log.entry(run.to_record())
    results = {"0": {"rank": 0, "status": "completed", "steps_completed": 5}}
    ended = replace(run, ranks_ended=results, ended="completed")
    delta = log.entry(ended.to_record())
    assert delta["type"] == DELTA and delta["set"] == {"ranks_ended": results, "ended": "completed"}
    state, _ = fold([json.loads(json.dumps(first)), json.loads(json.dumps(delta))])
    assert state is not None and RunState.from_record(state) == ended
