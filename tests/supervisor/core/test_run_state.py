"""The versioned state record: round trips, an older remedy's record is migrated and resumed, a newer one refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remedy.policies import Engine, load_policy
from remedy.supervisor.core.control import Controller
from remedy.supervisor.core.run_state import SCHEMA, RunState, StateSchemaError, migrate
from remedy.supervisor.job_state import JobState, Phase

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


@pytest.mark.timeout(30)
def test_a_record_of_today_round_trips() -> None:
    """A RunState with a restart in progress comes back equal from its record."""
    run = RunState(
        incarnation=2,
        started=1.5,
        job=JobState(Phase.RECOVERING, 1, frozenset({3}), "rank_hang on rank 3", 1),
        slots=[{"rank": 3, "incarnation": 2, "state": "starting", "last_seq": 0, "gaps": []}],
        group={"generation": 1, "names": {}, "spares": [], "next_spare": 1},
        controller={"format": 1},
        recovery={"front": 19, "marks": {}, "detected_at": {"3": 1.0}, "records": []},
        crashed=("restart_rank:killed",),
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
