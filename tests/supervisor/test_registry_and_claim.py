"""The run registry (how status/apply find a private run) and run-directory claims."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from remedy.cli import registry
from remedy.protocol.exceptions import UsageError
from remedy.rundir.claim import MARKER, claim_run_dir
from remedy.rundir.names import RUN_FILES


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The registry under a scratch REMEDY_HOME."""
    monkeypatch.setenv("REMEDY_HOME", str(tmp_path))
    return tmp_path


def test_register_lookup_unregister(home: Path) -> None:
    """An entry is owner-only, found by run id while its process lives, and gone once unregistered."""
    registry.register("r1", {"address": "127.0.0.1:1", "token": "t"})
    path = home / "runs" / "r1.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    entry = registry.lookup("r1")
    assert entry is not None and entry["token"] == "t" and entry["pid"] == os.getpid()
    assert [e["run_id"] for e in registry.live_runs()] == ["r1"]
    registry.unregister("r1")
    assert registry.lookup("r1") is None and registry.live_runs() == []


def test_dead_and_broken_entries_are_ignored(home: Path) -> None:
    """An entry whose process is gone is removed; corrupt entries and path-like ids are ignored."""
    runs = home / "runs"
    runs.mkdir()
    (runs / "dead.json").write_text(json.dumps({"run_id": "dead", "pid": 2**22 + 12345}))
    (runs / "junk.json").write_bytes(b"\xff\x00")
    (runs / "list.json").write_text("[1]")
    assert registry.live_runs() == []
    assert not (runs / "dead.json").exists()
    assert registry.lookup("../runs/junk") is None


def test_entries_outlive_their_process_unless_lost_with_a_private_ray(home: Path) -> None:
    """An ended run's entry and a detached cluster run's entry stay after their process is gone;
    a private Ray's run that never ended does not."""
    runs = home / "runs"
    runs.mkdir()
    gone = 2**22 + 12345
    (runs / "ended.json").write_text(
        json.dumps({"run_id": "ended", "pid": gone, "state": "stopped"})
    )
    detached = {"run_id": "detached", "pid": gone, "mode": "cluster", "state": "running"}
    (runs / "detached.json").write_text(json.dumps(detached))
    lost = {"run_id": "lost", "pid": gone, "mode": "local", "state": "running"}
    (runs / "lost.json").write_text(json.dumps(lost))
    assert [e["run_id"] for e in registry.runs()] == ["detached", "ended"]
    assert [e["run_id"] for e in registry.live_runs()] == ["detached"]
    assert not (runs / "lost.json").exists()


def test_update_changes_fields_and_keeps_the_entry_private(home: Path) -> None:
    """`update` rewrites the entry owner-only; an unknown or path-like id is left alone."""
    registry.register("r1", {"address": "127.0.0.1:1", "token": "t", "ray_token": "secret"})
    registry.update("r1", state="completed", ray_token=None)
    entry = registry.lookup("r1")
    assert entry is not None and entry["state"] == "completed" and entry["ray_token"] is None
    assert entry["token"] == "t"
    assert stat.S_IMODE((home / "runs" / "r1.json").stat().st_mode) == 0o600
    registry.update("nope", state="completed")
    registry.update("../r1", state="failed")
    assert sorted(p.name for p in (home / "runs").iterdir()) == ["r1.json"]


def test_settle_ends_a_lost_private_run_instead_of_dropping_it(home: Path) -> None:
    """`settle` (the watchdog of a killed driver): the entry of a local run whose driver is gone
    gets its end state and is kept; an ended entry keeps the state it has."""
    runs = home / "runs"
    runs.mkdir()
    gone = 2**22 + 12345
    lost = {"run_id": "lost", "pid": gone, "mode": "local", "state": "running", "ray_token": "s"}
    (runs / "lost.json").write_text(json.dumps(lost))
    (runs / "ended.json").write_text(
        json.dumps({"run_id": "ended", "pid": gone, "state": "stopped"})
    )
    registry.settle("lost", "failed", ray_token=None)
    registry.settle("ended", "failed")
    entry = registry.lookup("lost")
    assert entry is not None and entry["state"] == "failed" and entry["ray_token"] is None
    assert stat.S_IMODE((runs / "lost.json").stat().st_mode) == 0o600
    assert (registry.lookup("ended") or {}).get("state") == "stopped"


def test_claim_and_release(tmp_path: Path) -> None:
    """A claim creates the folders and a marker; a second claim is refused; release removes what it made."""
    run_dir = tmp_path / "a" / "b" / "run"
    claim = claim_run_dir(run_dir, given="--run-dir x", run_id="r1")
    assert (run_dir / MARKER).read_text() == "r1\n"
    with pytest.raises(UsageError, match=r"--run-dir x: already holds a run \(\.remedy-run\)"):
        claim_run_dir(run_dir, given="--run-dir x", run_id="r2")
    claim.release()
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_directory_holding_any_run_file_is_refused(tmp_path: Path, name: str) -> None:
    """Each file of the run directory's one list (`rundir.names.RUN_FILES`) marks a run there already."""
    (tmp_path / name).write_text("{}\n")
    with pytest.raises(
        UsageError, match=rf"--run-dir x: already holds a run \({re.escape(name)}\)"
    ):
        claim_run_dir(tmp_path, given="--run-dir x", run_id="r2")


def test_started_claim_is_kept(tmp_path: Path) -> None:
    """Once the run has started, releasing keeps its directory and marker."""
    claim = claim_run_dir(tmp_path / "run", given="--run-dir x", run_id="r1")
    claim.started = True
    claim.release()
    assert (tmp_path / "run" / MARKER).exists()
