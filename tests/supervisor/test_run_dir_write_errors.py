"""RunDir: the first failed write names the file and the cause; after it the journals drop, the state records refuse."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from remedy.rundir.write_errors import FALLBACK_DIR_ENV, RunDirWriteError
from remedy.rundir.writer import RunDir

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")


@needs_dev_full
def test_a_full_disk_is_named_once_then_lines_drop_and_state_records_refuse(tmp_path: Path) -> None:
    """history.jsonl on /dev/full (ENOSPC at every write): one error naming it, then dropped lines."""
    run_dir = RunDir(tmp_path / "run", "r")
    (run_dir.path / "history.jsonl").symlink_to("/dev/full")
    with pytest.raises(RunDirWriteError) as caught:
        run_dir.history({"type": "x"})
    assert (
        str(caught.value) == f"{run_dir.path / 'history.jsonl'}: No space left on device (ENOSPC)"
    )
    run_dir.decision({"decision_id": "r-d00001"})  # dropped: the run is ending on the error
    assert run_dir.dropped == 1 and not (run_dir.path / "decisions.jsonl").exists()
    with pytest.raises(RunDirWriteError):
        run_dir.wal({"type": "state"})  # never a reply whose promise the journal lacks
    with pytest.raises(RunDirWriteError):
        run_dir.check()


def test_the_summary_goes_to_the_fallback_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run directory deleted under the run: check() says so (ENOENT); the summary goes elsewhere."""
    monkeypatch.setenv(FALLBACK_DIR_ENV, str(tmp_path / "fallback"))
    run_dir = RunDir(tmp_path / "run", "r")
    run_dir.history({"type": "x"})
    shutil.rmtree(run_dir.path)
    with pytest.raises(RunDirWriteError) as caught:
        run_dir.check()
    assert str(caught.value) == f"{run_dir.path}: the run directory was deleted (ENOENT)"
    written = run_dir.write_summary({"run_id": "r", "status": "failed"})
    assert written == tmp_path / "fallback" / "remedy-r" / "summary.json"
    assert json.loads(written.read_text())["status"] == "failed"


def test_the_error_crosses_an_actor_boundary_as_its_line(tmp_path: Path) -> None:
    """Pickled (as Ray sends it), the error keeps its one line and stays an OSError."""
    error = RunDirWriteError(tmp_path / "journal.wal", OSError(28, "No space left on device"))
    back = pickle.loads(pickle.dumps(error))
    assert isinstance(back, OSError) and str(back) == str(error)
