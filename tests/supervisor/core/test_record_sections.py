"""The typed record: each section reads and writes today's JSON, and `RunRecord` writes exactly
the record `RunState` (the same record as plain JSON sections) writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from remedy.control.job import JobState, Phase
from remedy.control.record import SCHEMA, RunRecord, RunState, StateLog, fold, migrate
from remedy.control.restart import RestartState, Stage
from remedy.control.sections import (
    GroupSection,
    HangEntry,
    HangSection,
    LossesSection,
    RestartSection,
    SlotSection,
)
from remedy.control.slots import RankSlots

OLD = Path(__file__).parent / "data" / "state_08a4111.json"
LAUNCHED = {"generation": 1, "source": 0, "replacements": {"3": "warm spare"}, "blocked": []}
GROUP = {
    "generation": 2,
    "names": {"0": "remedy-rank-r-0-i1", "1": "remedy-rank-r-1-i3"},
    "spares": ["remedy-spare-r-4"],
    "next_spare": 4,
    "spare_nodes": {"remedy-spare-r-4": "node-b"},
    "local_spares": ["remedy-spare-r-4"],
    "dead_nodes": ["node-c"],
}
RESTART = {
    "marks": {"suspected": 1.0, "killed": 2.0},
    "restart": RestartState("d1", 2, Stage.STEP, (1,), front=19, launched=LAUNCHED).to_dict(),
    "records": [{"ranks": [1], "detect_to_step_s": 3.5}],
}
LOSSES = {
    "detected_at": {"1": 1.0},
    "joining": {"1": "rank_hang on rank 1"},
    "losses": {"reported": [[1, 2]], "lost_on": {"1": ["node-c", 1.0]}, "held": {"node-c": [1]}},
}


def _today(**sections: Any) -> dict[str, Any]:
    """A state record as today's supervisor writes it (through JSON)."""
    slots = [{"rank": r, "incarnation": 1 + 2 * r, "state": "running", "gaps": [7] if r else [],
              "pid": 100 + r, "node": "node-a"} for r in range(2)]  # fmt: skip
    record = RunState(
        incarnation=3, started=1.5, job=JobState(Phase.RECOVERING, 2, frozenset({1}), "hang", 1),
        slots=slots, group=GROUP, controller={"format": 1, "seq": 4, "step_of": {"0": 3}},
        recovery={**RESTART, **LOSSES}, crashed=("restart_rank:killed",),
        last_seq={"0": 9, "1": 4}, hang={"0": [0.125, 3], "1": [0.2, 1]},
        ranks_ended=None, ended=None,
    ).to_record()  # fmt: skip
    return json.loads(json.dumps({**record, **sections}))


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"recovery": None},
        {"recovery": LOSSES},  # losses, no restart built yet
        {"recovery": {**RESTART, **LossesSection().to_json()}},  # a restart, nothing lost
        {"group": None, "hang": {}},
        {"ranks_ended": {"0": {"rank": 0, "status": "completed"}}, "ended": "completed"},
    ],
    ids=["whole", "no-recovery", "losses-only", "restart-only", "no-group", "ended"],
)
@pytest.mark.timeout(30)
def test_a_record_of_today_reads_as_typed_sections_and_writes_back_the_same_json(
    sections: dict[str, Any],
) -> None:
    """JSON in, typed record, the same JSON out; RunState (plain sections) writes the same."""
    record = _today(**sections)
    run = RunRecord.from_record(record)
    assert json.loads(json.dumps(run.to_record())) == record
    assert json.loads(json.dumps(RunState.from_record(record).to_record())) == record
    assert RunRecord.from_record(json.loads(json.dumps(run.to_record()))) == run


@pytest.mark.timeout(30)
def test_the_sections_are_typed() -> None:
    """Each section is a frozen value with typed fields, keyed by rank as an int."""
    run = RunRecord.from_record(_today())
    assert run.slots[1] == SlotSection(1, 3, "running", (7,), 101, "node-a")
    assert run.last_seq == {0: 9, 1: 4}
    assert run.group == GroupSection(
        2, {0: "remedy-rank-r-0-i1", 1: "remedy-rank-r-1-i3"}, ("remedy-spare-r-4",), 4,
        {"remedy-spare-r-4": "node-b"}, frozenset({"remedy-spare-r-4"}), frozenset({"node-c"}),
    )  # fmt: skip
    assert run.restart is not None and run.restart.machine is not None
    assert run.restart.machine.stage is Stage.STEP and run.restart.marks["killed"] == 2.0
    assert run.losses == LossesSection(
        {1: 1.0}, {1: "rank_hang on rank 1"}, ((1, 2),), {1: ("node-c", 1.0)}, {"node-c": (1,)}
    )
    assert run.hang == HangSection({0: HangEntry(0.125, 3), 1: HangEntry(0.2, 1)})
    with pytest.raises(AttributeError):
        run.group = None  # type: ignore[misc]


@pytest.mark.timeout(30)
def test_a_hang_entry_that_is_not_one_is_left_out() -> None:
    """A malformed entry gives its rank the start-up allowance (left out), as the watch did."""
    hang = HangSection.from_json({"0": [0.1, 2], "1": "x", "2": [True, 1], "x": [0.1, 1]})
    assert hang == HangSection({0: HangEntry(0.1, 2)})


@pytest.mark.timeout(30)
def test_an_older_record_reads_as_typed_sections_and_a_restart_section_is_none() -> None:
    """Schema 1 (remedy 0.1.0): no restart in progress, the group's spares as it kept them."""
    old = json.loads(OLD.read_text())
    run = RunRecord.from_record(old)
    assert run.restart is None and run.losses is None and run.recovery is None
    assert run.group is not None and run.group.generation == 0
    assert [s.incarnation for s in run.slots] == [1, 1]
    assert dict(run.controller) == migrate(old)["controller"]
    again = run.to_record()
    assert again["schema"] == SCHEMA and RunRecord.from_record(again) == run


@pytest.mark.timeout(30)
def test_slot_sections_are_given_again_while_unchanged_so_deltas_skip_them() -> None:
    """A report moves only last_seq: the next record's slots are the same objects, and the
    delta holds only the numbers."""
    slots = RankSlots(3)
    log = StateLog()

    def record() -> dict[str, Any]:
        return RunRecord(1, 1.0, JobState(), slots.sections(), slots.seqs()).to_record()

    first = slots.sections()
    slots.accept(1, 1, 1)  # the slot moves to running: its section is built again
    second = slots.sections()
    assert second[0] is first[0] and second[1] is not first[1]
    full = log.entry(record())
    slots.accept(1, 1, 2)
    third = slots.sections()
    assert third[1] is second[1] and third[1].to_json() is second[1].to_json()
    delta = log.entry(record())
    assert delta["ranks"] == {"last_seq": {1: 2}}
    state, _ = fold([json.loads(json.dumps(full)), json.loads(json.dumps(delta))])
    assert state is not None and RunRecord.from_record(state).last_seq == {0: 0, 1: 2, 2: 0}


@pytest.mark.timeout(30)
def test_a_restart_section_moves_by_replacing_it_whole() -> None:
    """A frozen section: a stage passed is a new section; the old one is left as it was."""
    section = RestartSection.from_json(RESTART)
    moved = RestartSection.from_json({**section.to_json(), "restart": None})
    assert moved.machine is None and section.machine is not None
    assert moved.to_json() == {**RESTART, "restart": None}
