"""journal.wal lost (or replaced by an older copy) mid-run, then the supervisor SIGKILLed: it knows it is not new."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from remedy.cli.runner import run_supervised
from remedy.control.identity import id_incarnation
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray]

HERE = Path(__file__).resolve().parent
TARGET = f"{HERE / 'daemon_train.py'}:main"
STEPS = 260
# Slow steps from step 200 until the third command (the rollback of the NaN at 200) is
# applied: the run outlasts the supervisor's restart.
ARGS = ["--steps", str(STEPS), "--step-s", "0.03", "--await-after", "200", "--await-s", "1.0",
        "--await-count", "3"]  # fmt: skip
FAULTS = [
    {"kind": "nan_loss", "at_step": 40, "rank": 0},
    {"kind": "kill_supervisor", "at_step": 150, "rank": 0},
    {"kind": "nan_loss", "at_step": 200, "rank": 0},
]


def _step_seen(run_dir: Path) -> int:
    """The highest step rank 0 reported so far (-1: none)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return -1
    steps = [
        json.loads(line).get("step", -1)
        for line in path.read_text().splitlines()
        if line.endswith("}") and '"rank": 0' in line
    ]
    return max(steps, default=-1)


def _at_step(run_dir: Path, step: int, act: Any) -> threading.Thread:
    """Run `act()` once rank 0 reported `step` (in a thread, beside the run)."""

    def watch() -> None:
        deadline = time.monotonic() + 120
        while _step_seen(run_dir) < step and time.monotonic() < deadline:
            time.sleep(0.02)
        act()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _run(tmp: Path, workers: int) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=workers, run_dir=str(tmp), faults=FAULTS, argv=ARGS,
        threads_per_rank=1, spares=0,
    )  # fmt: skip
    return run_supervised(spec)


def _assert_knew_it_was_not_new(tmp: Path, summary: dict[str, Any], workers: int) -> None:
    assert summary["status"] == "completed", summary
    history = read_jsonl(tmp / "history.jsonl")
    lost = [r for r in history if r["type"] == "journal_lost"]
    assert len(lost) == 1 and lost[0]["resumed_from_ranks"], lost
    assert lost[0]["incarnation"] == 2
    started = [r["incarnation"] for r in history if r["type"] == "supervisor_started"]
    assert started == [1, 2], started
    # How the first one died, as Ray says it (SIGKILLed: its worker ended with a system error).
    [died] = [r for r in history if r["type"] == "supervisor_died"]
    assert died["incarnation"] == 1 and died["exit_type"] == "SYSTEM_ERROR", died
    assert died["exit_detail"], died
    decisions = read_jsonl(tmp / "decisions.jsonl")
    ids = [d["decision_id"] for d in decisions]
    assert len(ids) == len(set(ids)), ids  # no id given twice
    # Both NaNs rolled back, the second by the restarted supervisor under its own ids.
    rollbacks = [
        d for d in decisions
        if d["action"] == "rollback" and d["anomaly"]["kind"] == "nonfinite_loss"
    ]  # fmt: skip
    assert [d["anomaly"]["step"] for d in rollbacks] == [40, 200], rollbacks
    assert [d["outcome"] for d in rollbacks] == ["applied", "applied"], rollbacks
    assert [id_incarnation(d["decision_id"]) for d in rollbacks] == [1, 2]
    # Every journaled outcome is its own action's: each rank applied each id once, for it.
    resolved = {r["decision_id"]: r for r in history if r["type"] == "resolved"}
    for d in decisions:
        detail = str(resolved.get(d["decision_id"], {}).get("detail", ""))
        assert "applied already" not in detail, (d, detail)
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [STEPS] * workers
    for rank in ranks:
        done = [a["decision_id"] for a in rank["result"]["applied"]]
        assert sorted(done) == sorted(set(done)) and set(done) <= set(ids)
        assert {a["outcome"] for a in rank["result"]["applied"]} == {"applied"}
    assert len({r["result"]["params_digest"] for r in ranks}) == 1


@pytest.mark.timeout(240)
def test_deleted_journal_then_a_killed_supervisor_resumes_from_the_ranks(
    ray_cluster: None, tmp_path: Path
) -> None:
    """journal.wal deleted at step 100, the supervisor SIGKILLed at 150: resumed from the ranks
    (journaled), no id twice, both NaN rollbacks applied once, the run completes."""
    watcher = _at_step(tmp_path, 100, lambda: os.unlink(tmp_path / "journal.wal"))
    summary = _run(tmp_path, 2)
    watcher.join(5)
    _assert_knew_it_was_not_new(tmp_path, summary, 2)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_journal_replaced_by_an_older_copy_is_found_behind_the_ranks(
    ray_cluster: None, tmp_path: Path
) -> None:
    """journal.wal copied at step 20 (before the first decision), put back at 100, the supervisor
    SIGKILLed at 150: found older than the ranks, resumed from them, no id twice."""
    copy = tmp_path.parent / f"{tmp_path.name}-journal.wal"
    first = _at_step(tmp_path, 20, lambda: shutil.copy(tmp_path / "journal.wal", copy))
    back = _at_step(tmp_path, 100, lambda: os.replace(copy, tmp_path / "journal.wal"))
    summary = _run(tmp_path, 2)
    first.join(5)
    back.join(5)
    _assert_knew_it_was_not_new(tmp_path, summary, 2)
