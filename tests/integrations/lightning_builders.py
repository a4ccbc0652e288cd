"""The `lightning.Trainer` the Lightning callback tests share: CPU, no logger, checkpoints,
progress bar or model summary, so a test's run holds only what the callback writes."""

from __future__ import annotations

from typing import Any

import lightning


def quiet_trainer(steps: int, callbacks: list[Any], **trainer: Any) -> Any:
    """A `lightning.Trainer` of `steps` optimizer steps on the CPU with `callbacks`; `trainer`
    adds or overrides its arguments (precision, accumulation, devices, strategy, ...)."""
    args: dict[str, Any] = {
        "max_steps": steps,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": callbacks,
    }
    return lightning.Trainer(**{**args, **trainer})
