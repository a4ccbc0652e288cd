"""nanoGPT's loop under `remedy run --workers 2`: a killed or hung rank is replaced and the run ends as a clean one."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from examples.nanogpt_shaped import get_lr, parse_args
from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'nanogpt_shaped.py'}:main"
STEPS = 40
ARGS = ["--max-iters", str(STEPS), "--eval-interval", "10", "--warmup-iters", "10",
        "--lr-decay-iters", str(STEPS), "--snapshot-every", "10", "--checkpoint-every", "20"]  # fmt: skip
WATCH = {"first_step_s": 4.0}

ROLLBACK_ONLY = """\
version: 1
name: rollback-only
rules:
  - name: nan
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 5, skip_batches: 2}
    max_fires: 1
  # Never fires (no spike is injected). A policy that names replay_step makes the ranks hold
  # at the boundary after a flagged step until it has decided on it (GuardConfig.flag_hold):
  # on a tiny model the run would otherwise end before a decision that a busy machine delays.
  - name: spike
    when: {anomaly: loss_spike}
    do:
      - replay_step: {}
"""


def _run(
    tmp: Path, faults: list[dict[str, Any]], policy: str = "default", spares: int = 1
) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp), faults=faults, argv=ARGS, policy=policy,
        threads_per_rank=1, hang_watch=WATCH, spares=spares,
    )  # fmt: skip
    return run_supervised(spec)


def _outcome(summary: dict[str, Any]) -> list[tuple[str, str, float, Any]]:
    """What must not differ from a clean run: per rank, the weights, the EMA, rank 0's evals."""
    return [
        (r["result"]["params_digest"], r["result"]["ema_digest"], r["result"]["best_val_loss"],
         r["result"]["evals"])
        for r in summary["ranks"]
    ]  # fmt: skip


@pytest.fixture(scope="module")
def clean(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same run without faults."""
    summary = _run(tmp_path_factory.mktemp("clean"), [], spares=0)  # no loss: no spare to start
    assert summary["status"] == "completed", summary
    assert summary["recoveries"] == []
    digests = {r["result"]["params_digest"] for r in summary["ranks"]}
    assert len(digests) == 1
    return summary


def _assert_replaced_once(
    summary: dict[str, Any], tmp: Path, clean: dict[str, Any], kind: str
) -> None:
    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [STEPS] * 2
    assert _outcome(summary) == _outcome(clean)  # bitwise: weights, EMA, rank 0's best_val_loss
    assert ranks[1]["incarnation"] == 2  # replaced once, and never again
    decisions = read_jsonl(tmp / "decisions.jsonl")
    restarts = [d for d in decisions if d["action"] == "restart_rank"]
    assert [(d["anomaly"]["kind"], d["outcome"], d["ranks"]) for d in restarts] == [
        (kind, "applied", [1])
    ], decisions
    # Nothing else went wrong: the replicas never split (no replica_divergence, no rollback).
    assert {d["action"] for d in decisions} == {"restart_rank"}, decisions
    [record] = summary["recoveries"]
    assert record["ranks"] == [1]
    phases = {
        r["to"]["phase"] for r in read_jsonl(tmp / "history.jsonl") if r.get("type") == "job_state"
    }
    assert "restarting-all" not in phases  # no full restart
    args = parse_args(ARGS)
    metrics = read_jsonl(tmp / "metrics.jsonl")
    assert [(m["rank"], m["step"]) for m in metrics if m["lr"] != get_lr(m["step"], args)] == []


@pytest.mark.timeout(300)
def test_killed_rank_is_replaced_and_the_loop_continues_at_its_step(
    clean: dict[str, Any], tmp_path: Path
) -> None:
    """kill_rank on rank 1 at step 15: replaced once; its loop starts at next_step 15 with the
    survivor's EMA; everything ends bitwise equal to the clean run, every LR on schedule."""
    summary = _run(tmp_path, [{"kind": "kill_rank", "at_step": 15, "rank": 1}])
    _assert_replaced_once(summary, tmp_path, clean, "rank_dead")


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_hung_rank_is_replaced_and_the_loop_continues_at_its_step(
    clean: dict[str, Any], tmp_path: Path
) -> None:
    """hang_rank on rank 1 at step 22: found, replaced once, the run ends bitwise equal to the clean one."""
    summary = _run(tmp_path, [{"kind": "hang_rank", "at_step": 22, "rank": 1}])
    _assert_replaced_once(summary, tmp_path, clean, "rank_hang")


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_after_a_rollback_every_rank_trains_each_step_at_its_scheduled_lr(
    ray_cluster: None, tmp_path: Path
) -> None:
    """NaN on rank 1 at step 27 -> both ranks roll back to step 20; the LR of every step each
    rank trained, the replayed ones too, is get_lr(step): no notch."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(ROLLBACK_ONLY)
    run = tmp_path / "run"
    summary = _run(run, [{"kind": "nan_loss", "at_step": 27, "rank": 1}], policy=str(policy))
    assert summary["status"] == "completed", summary
    rollbacks = [d for d in read_jsonl(run / "decisions.jsonl") if d["action"] == "rollback"]
    assert [d["outcome"] for d in rollbacks] == ["applied"]
    metrics = read_jsonl(run / "metrics.jsonl")
    assert Counter((m["rank"], m["step"]) for m in metrics)[(0, 22)] == 2  # replayed
    args = parse_args(ARGS)
    assert [(m["rank"], m["step"]) for m in metrics if m["lr"] != get_lr(m["step"], args)] == []
    assert len({r["result"]["params_digest"] for r in summary["ranks"]}) == 1
