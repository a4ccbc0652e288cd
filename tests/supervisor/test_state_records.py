"""journal.wal's state records: written when owed or due, read back whole, shared by waiting calls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from remedy.control.decide_state import split_at_last_state
from remedy.control.record import RunRecord
from remedy.control.run_core import OperatorStop, RunCore
from remedy.rundir.journals import read_journal
from remedy.rundir.writer import RunDir
from remedy.supervisor.state_records import StateRecords
from tests.supervisor.run_cores import empty_core


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    return RunDir(tmp_path / "run", "r")


def core_of() -> RunCore:
    return empty_core("records", world=2, incarnation=3)


def journal(run_dir: RunDir) -> list[dict[str, object]]:
    run_dir.close()
    return read_journal(run_dir.path / "journal.wal")


def test_a_record_is_owed_after_a_promise_until_one_is_written(run_dir: RunDir) -> None:
    """A new promise of the controller (a stop asked) owes a record; writing one pays it."""
    core = core_of()
    records = StateRecords(core, run_dir)
    assert records.owed()  # nothing written yet
    records.write()
    assert not records.owed()
    core.step(OperatorStop("operator"))
    assert records.owed()
    records.write(before_reply=True)
    assert not records.owed()


def test_the_written_record_reads_back_as_the_cores(run_dir: RunDir) -> None:
    """What is written is the core's record: a restarted supervisor reads its incarnation back."""
    core = core_of()
    StateRecords(core, run_dir).write()
    state, tail = split_at_last_state(journal(run_dir))
    assert state is not None and tail == []
    assert RunRecord.from_record(state).incarnation == 3


def test_a_fresh_log_is_due_and_a_written_one_is_not(run_dir: RunDir) -> None:
    """The loop's periodic record is due before the first and not right after one."""
    records = StateRecords(core_of(), run_dir)
    assert records.due()
    records.write()
    assert not records.due()


def test_an_unwritable_run_writes_no_records(run_dir: RunDir) -> None:
    """A run ending on its run directory's write error writes no more state records."""
    records = StateRecords(core_of(), run_dir)
    records.unwritable = True
    records.write()
    assert journal(run_dir) == []


def test_calls_waiting_together_share_one_record(run_dir: RunDir) -> None:
    """Calls that need a record while one is pending wait for the same one; none is written
    when nothing new was promised."""
    core = core_of()
    records = StateRecords(core, run_dir)
    kept: list[int] = []

    def keep() -> None:
        kept.append(1)
        records.write(before_reply=True)

    async def calls() -> None:
        await asyncio.gather(*(records.commit(keep) for _ in range(5)))
        await records.commit(keep)  # nothing new since: no record

    asyncio.run(calls())
    assert kept == [1]
    assert len(journal(run_dir)) == 1


def test_a_failed_record_fails_every_call_waiting_for_it(run_dir: RunDir) -> None:
    """The waiting calls fail with the record's error (their senders send again)."""
    records = StateRecords(core_of(), run_dir)

    def keep() -> None:
        raise OSError("disk full")

    async def calls() -> list[BaseException | None]:
        return await asyncio.gather(
            *(records.commit(keep) for _ in range(3)), return_exceptions=True
        )

    outcomes = asyncio.run(calls())
    assert [type(o) for o in outcomes] == [OSError] * 3
