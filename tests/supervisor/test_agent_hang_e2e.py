"""A hung rank of a run with node agents on is found by its node's agent and replaced alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
STEPS = 100
ARGS = ["--steps", str(STEPS), "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip


def test_a_hang_found_by_the_agent_is_replaced_and_the_run_completes(
    ray_cluster: None, tmp_path: Path
) -> None:
    """hang_rank (SIGSTOP) on rank 1 of 2 at step 15, agents on: the agent's sightings name it
    (`found_by: agent` in the anomaly), restart_rank replaces it, the run completes, and the
    supervisor pinged no rank to find it."""
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp_path), argv=ARGS, node_agents="on",
        threads_per_rank=1, spares=1, hang_watch={"first_step_s": 4.0},
        faults=[{"kind": "hang_rank", "at_step": 15, "rank": 1}],
    )  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    assert [r["steps_completed"] for r in summary["ranks"]] == [STEPS] * 2
    assert summary["ranks"][1]["incarnation"] >= 2
    decisions = read_jsonl(tmp_path / "decisions.jsonl")
    [restart] = [d for d in decisions if d["action"] == "restart_rank"]
    assert restart["outcome"] == "applied" and restart["ranks"] == [1], restart
    anomaly = restart["anomaly"]
    assert anomaly["kind"] == "rank_hang" and anomaly["rank"] == 1
    assert anomaly["details"]["found_by"] == "agent", anomaly
    assert "as its node's agent saw" in anomaly["details"]["reason"]
    # The restart saw the new generation step (the run goes on well past it; a run that ended
    # first would be settled without this record).
    [record] = summary["recoveries"]
    assert record["ranks"] == [1] and record["anomaly"] == "rank_hang"
    # Found without the supervisor pinging: its pings were the restart's own (it asks the
    # regrouped ranks how far they are), none before the detection.
    assert summary["supervisor_pings"] < 20, summary["supervisor_pings"]
