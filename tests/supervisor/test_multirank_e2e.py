"""Several ranks (DDP over gloo) apply the same remediation at the same boundary and stay identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
ARGS = ["--steps", "80", "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip


def test_two_ranks_roll_back_together_and_end_identical(ray_cluster: None, tmp_path: Path) -> None:
    """A NaN on rank 1 rolls both ranks back at the same step; both finish with bitwise-equal parameters."""
    faults = [{"kind": "nan_loss", "at_step": 40, "rank": 1}]
    # No rank is lost: no warm spare to start (the restart tests have theirs).
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp_path), faults=faults, argv=ARGS,
        threads_per_rank=1, spares=0,
    )  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed"
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [80, 80]
    assert ranks[0]["steps_executed"] == ranks[1]["steps_executed"] > 80
    assert ranks[0]["result"]["params_digest"] == ranks[1]["result"]["params_digest"]
    decisions = read_jsonl(tmp_path / "decisions.jsonl")
    rollback = next(d for d in decisions if d["action"] == "rollback")
    assert rollback["outcome"] == "applied"
    assert rollback["anomaly"]["rank"] == 1
    # One incident, one remedy: rank 0's NaN gradients (through the all-reduce) are merged
    # into rank 1's NaN loss; the LR gets the rule's one cut (x0.8), not a second (x0.5).
    assert len({d["chain"]["id"] for d in decisions}) == 1, decisions
    assert [(d["action"], d["params"].get("factor")) for d in decisions] == [
        ("rollback", None),
        ("shrink_lr", 0.8),
    ]
    merged = rollback["anomaly"]["details"]["merged"]
    assert {(m["kind"], m["rank"]) for m in merged} >= {("nonfinite_grad", 0)}
    # Both ranks restored the same step at the same boundary.
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    by_rank = {r: [(m["tick"], m["step"]) for m in metrics if m["rank"] == r] for r in (0, 1)}
    assert by_rank[0] == by_rank[1]
