"""A loss spike near a rank restart is found and rolled back: the ranks adopt the detectors' history."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
# The spike's rollback is decided once the restart is applied, a step or two before the last:
# the ranks must wait at their last boundary for it (rank.link.end_hold), and then train again.
STEPS = 34
ARGS = ["--steps", str(STEPS), "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip


def _run(tmp: Path, faults: list[dict[str, Any]]) -> dict[str, Any]:
    """`remedy run --workers 2` of the tiny GPT (gloo, a warm spare) with `faults`."""
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp), faults=faults, argv=ARGS,
        threads_per_rank=1, spares=1,
    )  # fmt: skip
    return run_supervised(spec)


def _assert_spike_rolled_back(
    summary: dict[str, Any], tmp: Path, *, restart_for: str, spike_at: int
) -> None:
    assert summary["status"] == "completed", summary
    decisions = read_jsonl(tmp / "decisions.jsonl")
    restart = [d for d in decisions if d["action"] == "restart_rank"]
    assert restart and restart[0]["outcome"] == "applied", decisions
    assert (restart[0]["anomaly"]["kind"], restart[0]["ranks"]) == (restart_for, [1])
    spikes = [
        a
        for a in read_jsonl(tmp / "anomalies.jsonl")
        if a["kind"] == "loss_spike" and a["rank"] == 0
    ]
    assert spikes, "the spike is detected"
    assert spikes[0]["step"] == spike_at
    # Judged against the adopted history, not by the warm-up bound of a reset detector.
    assert spikes[0]["details"]["history"] >= 20, spikes[0]
    rollbacks = [
        d for d in decisions if d["action"] == "rollback" and d["anomaly"]["kind"] == "loss_spike"
    ]
    assert rollbacks, decisions
    # Applied, never failed for want of ranks: the ranks wait at their last step for a
    # decision still owed (rank.link.end_hold), apply it, and train on to the end again.
    outcomes = [d["outcome"] for d in rollbacks]
    assert "applied" in outcomes and "failed" not in outcomes, rollbacks
    rollbacks = [d for d in rollbacks if d["outcome"] == "applied"]
    assert [r["steps_completed"] for r in summary["ranks"]] == [STEPS, STEPS]
    # Rolled back to a step before the spike: its update is undone.
    restored = re.search(r"restored step (\d+)", rollbacks[0]["detail"])
    assert restored is not None and int(restored.group(1)) < spike_at, rollbacks[0]


@pytest.mark.usefixtures("ray_cluster")
def test_a_spike_at_the_step_of_a_hang_is_rolled_back(tmp_path: Path) -> None:
    """loss_spike on rank 0 at the step rank 1 hangs: rank 1 is replaced, both ranks adopt
    rank 0's state with its detectors' history, the spike is found on the re-run and, once
    the restart is applied, rolled back."""
    faults = [
        {"kind": "hang_rank", "at_step": 30, "rank": 1},
        {"kind": "loss_spike", "at_step": 30, "rank": 0},
    ]
    summary = _run(tmp_path, faults)
    _assert_spike_rolled_back(summary, tmp_path, restart_for="rank_hang", spike_at=30)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_spike_five_steps_after_a_kill_is_rolled_back(tmp_path: Path) -> None:
    """kill_rank on rank 1 at step 25, loss_spike on rank 0 five steps after the restart: found
    against the adopted history and rolled back."""
    faults = [
        {"kind": "kill_rank", "at_step": 25, "rank": 1},
        {"kind": "loss_spike", "at_step": 30, "rank": 0},
    ]
    summary = _run(tmp_path, faults)
    _assert_spike_rolled_back(summary, tmp_path, restart_for="rank_dead", spike_at=30)
