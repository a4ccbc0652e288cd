"""The docs' worked example, examples/nanogpt_shaped.py, runs alone through a rollback with its hand-set LR intact."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from examples.nanogpt_shaped import get_lr, main, parse_args
from remedy.rank import WorkerContext, set_context
from remedy.rank.chaos.faults import parse_chaos
from remedy.rundir.writer import read_jsonl

ARGS = ["--max-iters", "50", "--eval-interval", "10", "--warmup-iters", "10",
        "--lr-decay-iters", "50", "--snapshot-every", "10", "--checkpoint-every", "25"]  # fmt: skip

ROLLBACK_ONLY = """\
version: 1
name: rollback-only
rules:
  - name: nan
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 5, skip_batches: 2}
    max_fires: 1
"""


@pytest.mark.timeout(240)
def test_after_a_rollback_every_step_trains_with_the_schedule_of_its_logical_step(
    tmp_path: Path,
) -> None:
    """NaN at step 33 -> rollback to step 20: the steps trained again use get_lr(step) (no notch),
    the EMA has folded in each kept step once, and rank 0's eval record went back with the model."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(ROLLBACK_ONLY)
    run = tmp_path / "run"
    faults = parse_chaos({"faults": [{"kind": "nan_loss", "at_step": 33}]})
    set_context(WorkerContext(run_dir=run, faults=faults))
    result = main([*ARGS, "--policy", str(policy)])
    [decision] = read_jsonl(run / "decisions.jsonl")
    assert decision["action"] == "rollback" and decision["outcome"] == "applied", decision
    metrics = read_jsonl(run / "metrics.jsonl")
    executions = Counter(m["step"] for m in metrics)
    assert executions[25] == 2 and executions[45] == 1  # steps 20..33 ran twice
    args = parse_args(ARGS)
    notches = [(m["step"], m["lr"]) for m in metrics if m["lr"] != get_lr(m["step"], args)]
    assert notches == []
    assert result["ema_step"] == 50
    # Evals ran at 0, 10, 20, 30, then 20 and 30 again after the rollback restored the record of 20.
    assert [step for step, _ in result["evals"]] == [0, 10, 20, 30, 40]
