"""End to end: the demo trains under a real supervisor actor and real Ray, faults are remediated."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"


def run_demo(run_dir: Path, faults: list[dict[str, Any]], *, steps: int = 300) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET,
        policy="default",
        workers=1,
        run_dir=str(run_dir),
        faults=faults,
        argv=["--steps", str(steps)],
    )
    return run_supervised(spec)


@pytest.fixture(scope="module")
def clean_run(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("clean")
    return run_dir, run_demo(run_dir, [])


@pytest.fixture(scope="module")
def nan_run(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("nan")
    return run_dir, run_demo(run_dir, [{"kind": "nan_loss", "at_step": 150, "rank": 0}])


@pytest.fixture(scope="module")
def spike_run(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("spike")
    return run_dir, run_demo(
        run_dir, [{"kind": "loss_spike", "at_step": 200, "rank": 0, "factor": 10, "duration": 2}]
    )


def test_clean_run_completes_without_anomalies(clean_run: tuple[Path, dict[str, Any]]) -> None:
    """A fault-free run completes every step, reports no anomaly and learns."""
    run_dir, summary = clean_run
    assert summary["status"] == "completed"
    assert summary["steps_completed"] == summary["steps_executed"] == 300
    # The training detectors stay silent. The one event is the KV-cache measure
    # finding the 1024-token chunk allocator's real waste during sampling.
    assert summary["anomalies"] == {"kv_fragmentation": 1}, "false positives on the clean baseline"
    actions = [d["action"] for d in read_jsonl(run_dir / "decisions.jsonl")]
    assert actions == ["switch_kv_allocator"]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert len(metrics) == 300
    result = summary["ranks"][0]["result"]
    first = metrics[0]["loss"]
    assert result["eval_loss"] < 0.75 * first, "the model must learn"


def test_nan_loss_is_rolled_back_and_run_matches_clean(
    nan_run: tuple[Path, dict[str, Any]], clean_run: tuple[Path, dict[str, Any]]
) -> None:
    """A NaN at step 150 is journaled as an applied rollback; the run ends finite and within 5% of clean."""
    run_dir, summary = nan_run
    assert summary["status"] == "completed"
    assert summary["steps_completed"] == 300
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    rollbacks = [d for d in decisions if d["action"] == "rollback"]
    assert rollbacks and rollbacks[0]["outcome"] == "applied"
    assert rollbacks[0]["anomaly"]["kind"] == "nonfinite_loss"
    assert rollbacks[0]["anomaly"]["step"] == 150
    assert rollbacks[0]["reason"]
    assert rollbacks[0]["result"]["restored_step"] < 150
    result = summary["ranks"][0]["result"]
    assert result["nonfinite_params"] == 0
    clean = clean_run[1]["ranks"][0]["result"]["eval_loss"]
    assert math.isfinite(result["eval_loss"])
    assert abs(result["eval_loss"] - clean) / clean < 0.05
    assert 0 < summary["goodput"] < 1


def test_journal_lines_have_the_contract_fields(nan_run: tuple[Path, dict[str, Any]]) -> None:
    """Every decisions.jsonl line carries the fields ARCHITECTURE.md promises."""
    run_dir, _ = nan_run
    required = {
        "ts",
        "run_id",
        "decision_id",
        "step",
        "ranks",
        "rule",
        "anomaly",
        "action",
        "params",
        "outcome",
        "reason",
    }
    for line in read_jsonl(run_dir / "decisions.jsonl"):
        assert required <= set(line)
        assert {"kind", "rank", "step", "value", "threshold"} <= set(line["anomaly"])
    summary = (run_dir / "summary.json").read_text()
    for key in (
        "status",
        "steps_completed",
        "steps_executed",
        "goodput",
        "final_loss",
        "actions",
        "wall_s",
    ):
        assert f'"{key}"' in summary


def test_loss_spike_rolls_back_and_skips_batches(spike_run: tuple[Path, dict[str, Any]]) -> None:
    """A loss spike leads to rollback with skip_batches; the skipped batches are never trained on afterwards."""
    run_dir, summary = spike_run
    assert summary["status"] == "completed"
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    rollback = next(d for d in decisions if d["action"] == "rollback" and d["outcome"] == "applied")
    assert rollback["anomaly"]["kind"] == "loss_spike"
    assert rollback["params"]["skip_batches"] > 0
    skipped = rollback["result"]["skipped_batches"]
    assert len(skipped) == rollback["params"]["skip_batches"]
    # The poisoned batches (trained at steps 200-201 before the rollback) are among the skipped.
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    poisoned = {m["batch_index"] for m in metrics if m.get("chaos")}
    assert poisoned and poisoned <= set(skipped)
    rolled_back_at = rollback["applied_at_step"]
    after = [
        m
        for m in metrics
        if m["tick"] >= rollback_tick(metrics, rolled_back_at, rollback["result"]["restored_step"])
    ]
    assert after, "training continued after the rollback"
    assert not {m["batch_index"] for m in after} & set(skipped)
    assert summary["skipped_batches"] == sorted(skipped)


def rollback_tick(metrics: list[dict[str, Any]], applied_at_step: int, restored_step: int) -> int:
    """The first tick after the rollback: where the step number went back to `restored_step`."""
    for prev, cur in itertools.pairwise(metrics):
        if cur["step"] == restored_step and prev["step"] >= restored_step:
            return int(cur["tick"])
    raise AssertionError(f"no rollback to step {restored_step} in metrics")
