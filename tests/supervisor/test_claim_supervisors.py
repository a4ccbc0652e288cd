"""The claim counts the supervisors of a run (with their pids): what outlives a lost journal.wal."""

from __future__ import annotations

from pathlib import Path

from remedy.rundir.claim import (
    MARKER,
    claim_run_dir,
    claimed_lives,
    claimed_supervisors,
    note_supervisor,
)


def test_each_supervisor_is_noted_in_the_claim(tmp_path: Path) -> None:
    """Two supervisors noted after the claim's run id: incarnations 1 and 2, with their pids."""
    claim = claim_run_dir(tmp_path / "run", given="run", run_id="r")
    assert claimed_lives(claim.path) == 0
    note_supervisor(claim.path, 1, 4242)
    note_supervisor(claim.path, 2, 4343)
    assert claimed_supervisors(claim.path) == {1: 4242, 2: 4343}
    assert claimed_lives(claim.path) == 2
    assert (claim.path / MARKER).read_text().splitlines()[0] == "r"


def test_a_damaged_or_older_claim_line_is_read_as_far_as_it_goes(tmp_path: Path) -> None:
    """A line without a pid (an older claim), a torn one, and no claim at all."""
    (tmp_path / MARKER).write_text(
        "r\nsupervisor 1\nsupervisor 2 pid 7\nsupervisor x pid 9\nsuperv"
    )
    assert claimed_supervisors(tmp_path) == {1: None, 2: 7}
    assert claimed_lives(tmp_path / "none") == 0
