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


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 4 * STEPS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # Counting sequences from a random start: learnable, so the test can see the model learn.
        start = int(torch.randint(0, 64, (1,), generator=torch.Generator().manual_seed(i)))
        ids = (start + torch.arange(16)) % 64
        return {"input_ids": ids, "labels": ids.clone()}


def test_nan_loss_under_trainer_is_rolled_back_and_training_completes(tmp_path: Path) -> None:
    """One NaN loss in a tiny GPT-2 under Trainer: skipped update, rollback and LR cut applied, all steps run."""
    from remedy.integrations.hf import RemedyCallback  # noqa: PLC0415 - after the importorskip

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    calls = [0]

    def poison(module: Any, inputs: Any, output: Any) -> Any:
        calls[0] += 1
        if calls[0] == NAN_AT_FORWARD:
            output.loss = output.loss * float("nan")  # a bad batch, as the real failure
        return output

    model.register_forward_hook(poison)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1000,
        dataloader_num_workers=0,
    )
    callback = RemedyCallback(run_dir=tmp_path / "run")
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[callback]
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
