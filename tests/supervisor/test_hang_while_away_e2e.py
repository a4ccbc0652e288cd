"""A rank that hangs while the supervisor is away is judged, when it returns, from the ranks' own
progress marks: found within its step-time timeout (not the start-up allowance), at its step."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.cli.runner import run_supervised
from remedy.control.hang_watch import HangWatchConfig
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
ARGS = ["--steps", "60", "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip


def test_a_rank_hung_while_the_supervisor_was_away_is_found_from_its_marks(
    ray_cluster: None, tmp_path: Path
) -> None:
    """The supervisor is SIGKILLed at step 30 and rank 1 stops (SIGSTOP) at step 32 before Ray
    has restarted it: the restarted supervisor names rank 1 hung on its step-time timeout, at
    step 32, and the stall is booked to rank_hang."""
    faults = [{"kind": "kill_supervisor", "at_step": 30, "rank": 0},
              {"kind": "hang_rank", "at_step": 32, "rank": 1}]  # fmt: skip
    spec = RunSpec(target=TARGET, workers=2, run_dir=str(tmp_path), faults=faults, argv=ARGS,
                   threads_per_rank=1, spares=1)  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    assert summary["supervisor_restarts"] == 1
    [d] = [d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["action"] == "restart_rank"]
    assert (d["anomaly"]["kind"], d["anomaly"]["rank"], d["anomaly"]["step"]) == (
        "rank_hang",
        1,
        32,
    )
    assert d["outcome"] == "applied"
    # Judged on its own timeout, not a new process's allowances (120 s, then 20 s).
    assert d["anomaly"]["details"]["timeout_s"] < HangWatchConfig().first_step_s, d
    assert summary["time_lost_by_cause"].get("rank_hang", 0) > 0
    assert all(r["seconds"] >= 0 for r in summary["time_lost"])
