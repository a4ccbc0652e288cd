"""The callbacks under torchrun, without a supervisor: the group decides once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from remedy.rundir.writer import metrics_paths, read_jsonl
from tests.paths import PYTHONPATH, REPO

HERE = Path(__file__).parent
STEPS, NAN_AT = 30, 12


def outcomes(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return json.loads((run_dir / "out" / f"outcomes.rank{rank}.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_a_callback_under_torchrun_decides_once_for_the_group(
    tmp_path: Path, framework: str
) -> None:
    """A NaN loss on rank 1 of a 2-rank DDP job (Lightning's DDP strategy; Hugging Face's
    Trainer through Accelerate) under `torchrun` (gloo): one decision for the group in
    decisions.jsonl, both ranks apply it at the same boundary, the run completes with both
    ranks' parameters bitwise equal."""
    pytest.importorskip({"lightning": "lightning", "hf": "transformers"}[framework])
    chaos = tmp_path / "chaos.yaml"
    chaos.write_text(f"faults:\n  - {{kind: nan_loss, at_step: {NAN_AT}, rank: 1}}\n")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "REMEDY_CHAOS": str(chaos)}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv += [str(HERE / f"launched_{framework}.py"), "--run-dir", str(run_dir)]
    argv += ["--steps", str(STEPS)]
    proc = subprocess.run(
        argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=280, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "rank 0 decides for the group" in proc.stderr  # said once, at start

    # One rule fired once, for the group: its chain (rollback, then the LR cut) is every line.
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    assert [(d["action"], d["outcome"]) for d in decisions] == [
        ("rollback", "applied"),
        ("shrink_lr", "applied"),
    ]
    first = decisions[0]
    assert {d["chain"]["id"] for d in decisions} == {first["decision_id"]}
    assert (first["rule"], first["ranks"]) == ("nan-rollback", [1])
    assert (first["anomaly"]["kind"], first["anomaly"]["rank"], first["anomaly"]["step"]) == (
        "nonfinite_loss",
        1,
        NAN_AT,
    )
    # Rank 0's NaN gradient (DDP averaged rank 1's NaN into it) is the same incident.
    merged = first["anomaly"]["details"]["merged"]
    assert [(m["kind"], m["rank"]) for m in merged] == [("nonfinite_grad", 0)]
    seen = {(a["kind"], a["rank"]) for a in read_jsonl(run_dir / "anomalies.jsonl")}
    assert seen == {("nonfinite_loss", 1), ("nonfinite_grad", 0)}

    # Both ranks applied both commands at the same boundary (tick), each as itself.
    ours = [outcomes(run_dir, r) for r in (0, 1)]
    for rank, got in enumerate(ours):
        assert [o["rank"] for o in got] == [rank, rank]
        assert [o["decision_id"] for o in got] == [d["decision_id"] for d in decisions]
    assert [(o["tick"], o["outcome"]) for o in ours[0]] == [
        (o["tick"], o["outcome"]) for o in ours[1]
    ]
    rollback = ours[0][0]
    # Each rank's step records (rank 0's in metrics.jsonl, rank 1's in its own file): the same
    # logical step at every executed step, so no rank went on alone.
    records = [m for f in metrics_paths(run_dir) for m in read_jsonl(f)]
    steps_at = [{m["tick"]: m["step"] for m in records if m["rank"] == r} for r in (0, 1)]
    assert steps_at[0] and steps_at[0] == steps_at[1]
    assert steps_at[0][rollback["tick"]] == rollback["result"]["restored_step"]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["workers"], summary["launcher"]) == (
        "completed",
        2,
        "torchrun",
    )
    done = [r["steps_completed"] for r in summary["ranks"]]
    # Lightning trains the steps the rollback undid again; HF's max_steps counts executed steps.
    undone = rollback["result"]["from_step"] - rollback["result"]["restored_step"]
    assert done == ([STEPS] * 2 if framework == "lightning" else [STEPS - undone] * 2)
    a = torch.load(run_dir / "out" / "params.rank0.pt")
    b = torch.load(run_dir / "out" / "params.rank1.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
