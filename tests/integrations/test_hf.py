"""The Hugging Face callback: a NaN loss under a real `transformers.Trainer` is detected and rolled back."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from remedy.rundir.writer import read_jsonl

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180)]

STEPS = 40
NAN_AT_FORWARD = 15


def test_nan_loss_under_trainer_is_rolled_back_and_training_completes(tmp_path: Path) -> None:
    """One NaN loss in a tiny GPT-2 under Trainer: skipped update, rollback and LR cut applied, all steps run."""
    from remedy.integrations.hf import RemedyCallback  # noqa: PLC0415 - after the importorskip
    from tests.integrations.hf_builders import CountingTokens, cpu_args, tiny_gpt2  # noqa: PLC0415

    model = tiny_gpt2()
    calls = [0]

    def poison(module: Any, inputs: Any, output: Any) -> Any:
        calls[0] += 1
        if calls[0] == NAN_AT_FORWARD:
            output.loss = output.loss * float("nan")  # a bad batch, as the real failure
        return output

    model.register_forward_hook(poison)
    callback = RemedyCallback(run_dir=tmp_path / "run")
    trainer = transformers.Trainer(
        model=model,
        args=cpu_args(tmp_path / "out", STEPS),
        train_dataset=CountingTokens(4 * STEPS),
        callbacks=[callback],
    )
    trainer.train()

    assert trainer.state.global_step == STEPS, "training completes"
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    applied = {d["action"] for d in decisions if d["outcome"] == "applied"}
    assert {"rollback", "shrink_lr"} <= applied
    assert any(
        a["kind"] == "nonfinite_loss" for a in read_jsonl(tmp_path / "run" / "anomalies.jsonl")
    )
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    # The NaN step's update is dropped, then the 10 skipped batches' (default policy); no other.
    assert sum(m["optimizer_skipped"] for m in metrics) == 1 + 10
    first = sum(m["loss"] for m in metrics[:5]) / 5
    last = sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < 0.9 * first, "the model learns"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert math.isfinite(float(metrics[-1]["loss"]))
