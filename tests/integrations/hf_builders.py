"""The tiny Hugging Face setup the HF callback tests share: a small GPT-2, `TrainingArguments`
for a short quiet CPU run, and learnable token sequences.

Each test adds only what it is about (its fault, its callback, its optimizer); the
model and the Trainer's arguments are the same everywhere unless a test overrides one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

GPT2 = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32}


class CountingTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """`n` sequences of 16 tokens counting from a random start (one per index): learnable."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = int(torch.randint(0, 64, (1,), generator=torch.Generator().manual_seed(i)))
        ids = (start + torch.arange(16)) % 64
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_gpt2(**config: Any) -> Any:
    """A GPT-2 of one layer, width 32, 2 heads, 64 tokens, 32 positions (`config` overrides any),
    its weights from seed 0."""
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**GPT2, **config}))


def cpu_args(output_dir: Path | str, steps: int, **overrides: Any) -> Any:
    """`TrainingArguments` for `steps` optimizer steps on the CPU: batches of 4, LR 1e-2, no saves,
    reports, progress bar, logging or loader workers (`overrides` win)."""
    args: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": steps,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "logging_steps": 1000,
        "dataloader_num_workers": 0,
    }
    return transformers.TrainingArguments(**{**args, **overrides})
