"""`remedy logs` reads the history (and an older run's journal.wal) for what happened to the job,
never the state records."""

from __future__ import annotations

from remedy.cli.run_commands import history_line
from remedy.control.job import JobState
from remedy.control.record import RunState, StateLog


def test_state_records_full_and_delta_make_no_log_line() -> None:
    """Both kinds the state log writes: the first record in full, the next one as a delta."""
    log = StateLog()
    slots = [{"rank": 0, "incarnation": 1, "last_seq": 3}]
    record = RunState(1, 1.0, JobState(), slots, None, {}).to_record()
    full = log.entry(record)
    delta = log.entry({**record, "crashed": [2]})
    assert full["type"] == "state" and delta["type"] == "state_delta"
    assert history_line(full) is None and history_line(delta) is None
    said = history_line({"type": "job_state", "to": {"phase": "degraded"}, "reason": "rank 2 lost"})
    assert said == "remedy: job degraded: rank 2 lost"
