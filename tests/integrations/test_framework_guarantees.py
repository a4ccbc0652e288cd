"""The Guard's guarantees under the HF and Lightning callbacks, on loops unlike the bundled examples.

HF: a Trainer with gradient accumulation and clipping; Lightning: accumulation
and bf16. Each test fails on the callbacks as they were before (see issue text
in the commit that added it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remedy.rank.chaos.faults import parse_chaos
from remedy.rank.exceptions import ChaosConfigError
from remedy.rank.link.context import WorkerContext
from remedy.rundir.writer import read_jsonl

transformers = pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")

from tests.integrations.hf_builders import CountingTokens, cpu_args, tiny_gpt2  # noqa: E402
from tests.integrations.lightning_builders import quiet_trainer  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(240)]


# ---------------------------------------------------------------- HF Trainer
def _hf_trainer(
    tmp_path: Path,
    steps: int,
    callback: Any,
    lr_factor: Callable[[int], float] | None = None,
    **args: Any,
) -> Any:
    """A 1-layer GPT-2 Trainer; `lr_factor` gives it an AdamW whose LR that schedule scales."""
    model = tiny_gpt2()
    optimizers: Any = (None, None)
    if lr_factor is not None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor))
    targs = cpu_args(
        tmp_path / "out", steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=1.0, **args,
    )  # fmt: skip
    return transformers.Trainer(
        model=model,
        args=targs,
        train_dataset=CountingTokens(8 * steps),
        callbacks=[callback],
        optimizers=optimizers,
    )


def test_hf_grad_norm_is_read_before_clipping_and_chaos_is_injected(tmp_path: Path) -> None:
    """HF, accumulation 2, max_grad_norm 1: a chaos grad explosion raises grad_norm_explosion with the raw norm."""
    from remedy.integrations.hf import RemedyCallback  # noqa: PLC0415 - after the importorskip

    faults = parse_chaos({"faults": [{"kind": "grad_explosion", "at_step": 12, "rank": 0}]})
    callback = RemedyCallback(run_dir=tmp_path / "run", context=WorkerContext(faults=faults))
    trainer = _hf_trainer(tmp_path, 20, callback)
    trainer.train()
    assert trainer.args.max_grad_norm == 1.0, "the user's arguments are given back"
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 20, "one record per optimizer step, not per micro-batch"
    assert metrics[12]["chaos"][0]["fault"] == "grad_explosion"
    assert metrics[12]["grad_norm"] > 1e4, "the norm before clipping"
    kinds = [a["kind"] for a in read_jsonl(tmp_path / "run" / "anomalies.jsonl")]
    assert "grad_norm_explosion" in kinds
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_hf_bad_lr_raises_grad_norm_explosion_with_the_norm_before_clipping(
    tmp_path: Path,
) -> None:
    """HF, max_grad_norm 1: an LR schedule whose step 30 multiplies the LR by 300 (a bad LR, no
    chaos): the norm jumps from ~1 to far above 1 before the Trainer's clipping, and the Guard's
    detectors call it grad_norm_explosion against the norm's own median."""
    from remedy.integrations.hf import RemedyCallback  # noqa: PLC0415

    callback = RemedyCallback(run_dir=tmp_path / "run")
    trainer = _hf_trainer(tmp_path, 40, callback, lr_factor=lambda s: 1.0 if s < 30 else 300.0)
    trainer.train()
    explosions = [
        a for a in read_jsonl(tmp_path / "run" / "anomalies.jsonl")
        if a["kind"] == "grad_norm_explosion"
    ]  # fmt: skip
    assert explosions, "the bad LR went unnoticed"
    first = explosions[0]
    assert first["step"] in (30, 31) and first["value"] > 10.0, first
    assert first["value"] > 10 * first["details"]["baseline"] > 1.0, "judged before clipping"


def test_hf_run_writes_summary_and_says_why_rollbacks_left_steps_untrained(
    tmp_path: Path,
) -> None:
    """HF with a NaN and its rollback: summary.json is written and says how many logical steps were trained."""
    from remedy.cli.main import main as remedy_main  # noqa: PLC0415
    from remedy.integrations.hf import RemedyCallback  # noqa: PLC0415

    faults = parse_chaos({"faults": [{"kind": "nan_loss", "at_step": 15, "rank": 0}]})
    callback = RemedyCallback(run_dir=tmp_path / "run", context=WorkerContext(faults=faults))
    trainer = _hf_trainer(tmp_path, 30, callback)
    trainer.train()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["actions"].get("rollback") == 1
    (rank,) = summary["ranks"]
    assert rank["steps_executed"] == 30
    assert rank["steps_completed"] < 30
    assert f"trained {rank['steps_completed']} of the 30 logical steps" in rank["short_of_asked"]
    assert summary["goodput"] < rank["steps_completed"] / 30, "skipped updates count against it"
    assert remedy_main(["report", str(tmp_path / "run")]) == 0, "a finished run, not 'running'"


def test_chaos_a_callback_cannot_inject_is_refused_in_one_line(tmp_path: Path) -> None:
    """An OOM fault under the HF callback: refused with one line naming it, before training."""
    from remedy.integrations.hf import RemedyCallback  # noqa: PLC0415

    faults = parse_chaos({"faults": [{"kind": "oom", "at_step": 3, "rank": 0}]})
    callback = RemedyCallback(run_dir=tmp_path / "run", context=WorkerContext(faults=faults))
    trainer = _hf_trainer(tmp_path, 5, callback)
    with pytest.raises(ChaosConfigError) as info:
        trainer.train()
    assert "\n" not in str(info.value)
    assert "cannot inject oom under a framework callback" in str(info.value)


# ----------------------------------------------------------------- Lightning
class Forecaster(lightning.LightningModule):  # type: ignore[misc]
    """A small regression with OneCycleLR; no faults of its own."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.steps = steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _series(n: int) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.01 * torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _fit(tmp_path: Path, steps: int, callback: Any, batches: int) -> Any:
    torch.manual_seed(0)
    module = Forecaster(steps + 50)  # room in the schedule for replayed steps
    trainer = quiet_trainer(
        steps, [callback], precision="bf16-mixed", accumulate_grad_batches=2,
        gradient_clip_val=1.0, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, _series(8 * batches))
    return trainer


def test_lightning_accumulation_clean_run_has_no_events_and_counts_optimizer_steps(
    tmp_path: Path,
) -> None:
    """Lightning, accumulation 2, bf16: 0 events on a clean run, 60 optimizer steps counted as 60."""
    from remedy.integrations.lightning import RemedyCallback  # noqa: PLC0415

    trainer = _fit(tmp_path, 60, RemedyCallback(run_dir=tmp_path / "run"), batches=400)
    assert trainer.global_step == 60
    assert read_jsonl(tmp_path / "run" / "anomalies.jsonl") == []
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(60))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_completed"] == summary["steps_executed"] == 60
    assert summary["goodput"] == 1.0


def test_lightning_rollback_trains_the_asked_for_logical_steps(tmp_path: Path) -> None:
    """Lightning with a chaos NaN: rolled back, and training goes on until 40 logical steps are trained."""
    from remedy.integrations.lightning import RemedyCallback  # noqa: PLC0415

    faults = parse_chaos({"faults": [{"kind": "nan_loss", "at_step": 25, "rank": 0}]})
    callback = RemedyCallback(run_dir=tmp_path / "run", context=WorkerContext(faults=faults))
    trainer = _fit(tmp_path, 40, callback, batches=400)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["actions"].get("rollback") == 1
    (rank,) = summary["ranks"]
    assert rank["steps_completed"] == 40, rank
    assert rank["steps_executed"] == trainer.global_step > 40
    assert "short_of_asked" not in rank
