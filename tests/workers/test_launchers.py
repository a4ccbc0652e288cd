"""The Guard under torchrun, without a supervisor: the group decides once, a restart resumes."""

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

HERE = Path(__file__).parent
SCRIPT = HERE / "launched_train.py"
REPO = HERE.parent.parent


def torchrun(
    tmp_path: Path,
    chaos: str,
    *,
    steps: int,
    restarts: int = 0,
    env: dict[str, str] | None = None,
    expect_rc: int | None = 0,
    extra: tuple[str, ...] = (),
) -> Any:
    """Run the README's DDP loop on 2 ranks under real torchrun (gloo, CPU); its run directory
    (the finished process with `expect_rc=None`)."""
    chaos_file = tmp_path / "chaos.yaml"
    chaos_file.write_text(chaos)
    run_dir = tmp_path / "run"
    env = {**os.environ, "REMEDY_CHAOS": str(chaos_file), "OMP_NUM_THREADS": "1", **(env or {})}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv += ["--max-restarts", str(restarts), str(SCRIPT), "--run-dir", str(run_dir)]
    argv += ["--steps", str(steps), *extra]
    proc = subprocess.run(
        argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=280, check=False
    )
    if expect_rc is None:
        return proc
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-6000:]
    return run_dir


def params_equal(run_dir: Path) -> bool:
    a = torch.load(run_dir / "out" / "params.rank0.pt")
    b = torch.load(run_dir / "out" / "params.rank1.pt")
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def outcomes(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return json.loads((run_dir / "out" / f"outcomes.rank{rank}.json").read_text())


@pytest.mark.timeout(300)
def test_torchrun_nan_on_one_rank_is_one_group_decision(tmp_path: Path) -> None:
    """A NaN loss on rank 1 under torchrun: one decision for the group, applied by both ranks at
    the same boundary; the run completes with both ranks' parameters bitwise equal."""
    run_dir = torchrun(tmp_path, "faults:\n  - {kind: nan_loss, at_step: 12, rank: 1}\n", steps=30)

    decisions = read_jsonl(run_dir / "decisions.jsonl")
    assert decisions, "no decision journaled"
    # One rule fired once: its chain's steps (rollback, then the LR cut) are its lines.
    assert {d["chain"]["id"] for d in decisions} == {decisions[0]["decision_id"]}
    assert [d["action"] for d in decisions] == ["rollback", "shrink_lr"]
    assert {d["outcome"] for d in decisions} == {"applied"}
    first = decisions[0]
    assert first["rule"] == "nan-rollback"
    assert first["ranks"] == [1]
    assert (first["anomaly"]["kind"], first["anomaly"]["rank"], first["anomaly"]["step"]) == (
        "nonfinite_loss",
        1,
        12,
    )
    merged = first["anomaly"]["details"]["merged"]
    assert [(m["kind"], m["rank"]) for m in merged] == [("nonfinite_grad", 0)]
    # Every rank journals as itself: both anomalies of the step, each with its own rank.
    seen = {(a["kind"], a["rank"]) for a in read_jsonl(run_dir / "anomalies.jsonl")}
    assert seen == {("nonfinite_loss", 1), ("nonfinite_grad", 0)}

    # Both ranks applied the same commands at the same boundary (tick), with the same result.
    ours = [outcomes(run_dir, r) for r in (0, 1)]
    for rank, got in enumerate(ours):
        assert [o["rank"] for o in got] == [rank, rank]
    strip = [[{k: v for k, v in o.items() if k != "rank"} for o in got] for got in ours]
    assert strip[0] == strip[1]
    rollback = ours[0][0]
    assert rollback["decision_id"] == first["decision_id"]
    assert rollback["result"]["restored_step"] == 0

    # Each rank's step records: rank 0's in metrics.jsonl, rank 1's in its own file.
    records = [m for f in metrics_paths(run_dir) for m in read_jsonl(f)]
    by_rank = {r: [m for m in records if m["rank"] == r] for r in (0, 1)}
    assert by_rank[0] and by_rank[1]
    steps_at = [{m["tick"]: m["step"] for m in by_rank[r]} for r in (0, 1)]
    assert steps_at[0] == steps_at[1]  # the same step at every executed step: no rank went alone
    assert steps_at[0][rollback["tick"]] == 0  # the step after the boundary trained step 0 again

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["workers"] == 2
    assert summary["launcher"] == "torchrun"
    # The ranks exchanged reports only around the fault (the anomalies, then the outcomes),
    # never at every step: a clean step pays only the agreement.
    assert 1 <= summary["exchanges"] <= 6
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert all(r["steps_completed"] == 30 for r in summary["ranks"])
    assert params_equal(run_dir)


ROLLBACK_THEN_LR = """\
version: 1
name: rollback-then-cut
rules:
  - name: nan-rollback
    when: {anomaly: [nonfinite_loss, nonfinite_grad]}
    do:
      - rollback: {steps_back: 5, skip_batches: 1}
        on_failure: next
      - shrink_lr: {factor: 0.5}
    max_fires: 1
"""


@pytest.mark.timeout(300)
def test_torchrun_a_state_that_fails_to_load_on_one_rank_fails_the_rollback_on_both(
    tmp_path: Path,
) -> None:
    """Rank 1's loop state refuses to load during a rollback under torchrun: the rollback fails
    on both ranks with rank 1's reason (rank 0 puts its state back), neither rank goes back, the
    policy's next step (the LR cut) runs, and the replicas stay bitwise equal."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(ROLLBACK_THEN_LR)
    run_dir = torchrun(
        tmp_path,
        "faults:\n  - {kind: nan_loss, at_step: 12, rank: 0}\n",
        steps=20,
        extra=("--policy", str(policy), "--broken-state-rank", "1"),
    )
    decisions = {d["action"]: d for d in read_jsonl(run_dir / "decisions.jsonl")}
    assert decisions["rollback"]["outcome"] == "failed", decisions["rollback"]
    assert decisions["shrink_lr"]["outcome"] == "applied"
    ours = [outcomes(run_dir, r) for r in (0, 1)]
    assert [[o["outcome"] for o in got] for got in ours] == [["failed", "applied"]] * 2
    refused = "load_state_dict raised RuntimeError: this rank's loop state refuses to load"
    assert refused in ours[1][0]["detail"]
    assert f"rank 1 could not restore: state 'loop': {refused}" in ours[0][0]["detail"]
    assert "no rank restored anything" in ours[0][0]["detail"]
    trained = [json.loads((run_dir / "out" / f"trained.rank{r}.json").read_text()) for r in (0, 1)]
    assert trained == [20, 20]  # nothing went back, nothing was lost
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert all(r["steps_executed"] == 20 for r in summary["ranks"]), summary["ranks"]
    assert params_equal(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_restart_resumes_from_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed at step 35 under `torchrun --max-restarts 1`: the elastic agent restarts
    the group, every rank resumes from step 30 (the newest both committed) and completes. A NaN
    before the kill and one after the restart are each decided once and applied by both ranks:
    the restarted group's decisions are not mistaken for those done before the checkpoint."""
    chaos = (
        "faults:\n  - {kind: nan_loss, at_step: 12, rank: 1}\n"
        "  - {kind: kill_rank, at_step: 35, rank: 1}\n"
        "  - {kind: nan_loss, at_step: 45, rank: 1}\n"
    )
    run_dir = torchrun(tmp_path, chaos, steps=60, restarts=1)
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    assert [(d["step"], d["action"], d["outcome"]) for d in decisions] == [
        (12, "rollback", "applied"),
        (12, "shrink_lr", "applied"),
        (45, "rollback", "applied"),
        (45, "shrink_lr", "applied"),
    ]
    after = decisions[2:]
    assert all(d["decision_id"].startswith("local-restart1-") for d in after)
    applied = [outcomes(run_dir, r) for r in (0, 1)]  # the restarted processes' own
    assert [o["decision_id"] for o in applied[0]] == [d["decision_id"] for d in after]
    assert [(o["decision_id"], o["tick"]) for o in applied[0]] == [
        (o["decision_id"], o["tick"]) for o in applied[1]
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    for rank in summary["ranks"]:
        assert rank["steps_completed"] == 60
        assert rank["resumed"]["step"] == 30
    assert params_equal(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_hung_peer_ends_the_rank_with_its_reason(tmp_path: Path) -> None:
    """Rank 1 hung (SIGSTOP) at step 12, REMEDY_COLLECTIVE_TIMEOUT_S=8: rank 0's collective times
    out and it ends with `GroupLostError` naming the step and the cause; the summary says failed."""
    proc = torchrun(
        tmp_path,
        "faults:\n  - {kind: hang_rank, at_step: 12, rank: 1}\n",
        steps=30,
        env={"REMEDY_COLLECTIVE_TIMEOUT_S": "8"},
        expect_rc=None,
    )
    assert isinstance(proc, subprocess.CompletedProcess)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "GroupLostError: rank 0 at step 12: a collective of the process group failed" in out
    # The collective's own words follow the bound: gloo's "Timed out waiting 8000ms for recv
    # operation" or "Application timeout caused pair closure", as the timing falls.
    cause = out.split("REMEDY_COLLECTIVE_TIMEOUT_S): ")[1].split("; under torchrun")[0].lower()
    assert "timed out" in cause or "timeout" in cause
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_replay_gets_its_answer_by_exchange(tmp_path: Path) -> None:
    """Under llm-pretrain (which replays), a NaN on rank 1: both ranks replay the step, the answer
    reaches both while they hold; its restart_rank fails (no worker group under a launcher) and
    the rule's abort stops both ranks at the same step."""
    run_dir = torchrun(
        tmp_path,
        "faults:\n  - {kind: nan_loss, at_step: 12, rank: 1}\n",
        steps=30,
        extra=("--policy", "llm-pretrain"),
    )
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    got = [(d["rule"], d["action"], d["outcome"]) for d in decisions]
    assert got[0] == ("replay-first", "replay_step", "applied")
    assert ("bad-chip-restart", "restart_rank", "failed") in got
    assert ("bad-chip-restart", "abort", "applied") in got
    applied = [outcomes(run_dir, r) for r in (0, 1)]
    assert [(o["decision_id"], o["tick"]) for o in applied[0]] == [
        (o["decision_id"], o["tick"]) for o in applied[1]
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "aborted"
    assert [r["steps_completed"] for r in summary["ranks"]] == [12, 12]
