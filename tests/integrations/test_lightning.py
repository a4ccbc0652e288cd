"""The Lightning callback: a NaN loss in a tiny LightningModule under a real `lightning.Trainer` is rolled back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remedy.rundir.writer import read_jsonl

lightning = pytest.importorskip("lightning")

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180)]

STEPS = 40
NAN_AT_BATCH = 15


class Regression(lightning.LightningModule):  # type: ignore[misc]
    """y = x @ w on generated data; one training step returns a NaN loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.calls += 1
        if self.calls == NAN_AT_BATCH:
            loss = loss * float("nan")  # a bad batch, as the real failure
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * STEPS, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def test_nan_loss_under_lightning_is_rolled_back_and_training_completes(tmp_path: Path) -> None:
    """One NaN loss under lightning.Trainer: update dropped, rollback and LR cut applied, every step runs."""
    from remedy.integrations.lightning import RemedyCallback  # noqa: PLC0415 - after the importorskip
    from tests.integrations.lightning_builders import quiet_trainer  # noqa: PLC0415

    torch.manual_seed(0)
    module = Regression()
    callback = RemedyCallback(run_dir=tmp_path / "run")
    trainer = quiet_trainer(STEPS, [callback], default_root_dir=str(tmp_path))
    trainer.fit(module, data())

    assert callback.guard is not None
    assert callback.guard.step_count == STEPS, "the asked-for logical steps are trained"
    assert trainer.global_step > STEPS, "the steps the rollback undid are trained again"
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    applied = {d["action"] for d in decisions if d["outcome"] == "applied"}
    assert {"rollback", "shrink_lr"} <= applied
    rollback = next(d for d in decisions if d["action"] == "rollback")
    assert rollback["result"]["restored_step"] < NAN_AT_BATCH
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    # The NaN step's update is dropped, then the 10 skipped batches' (default policy); no other.
    assert sum(m["optimizer_skipped"] for m in metrics) == 1 + 10
    first = sum(m["loss"] for m in metrics[:5]) / 5
    last = sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < 0.9 * first, "the model learns"
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.ray
def test_callback_under_remedy_run_reports_to_the_supervisor(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Under a supervisor the callback's NaN reaches the supervisor's policy; its rollback is applied in the rank."""
    from remedy.cli.runner import run_supervised  # noqa: PLC0415 - Ray side, only here
    from remedy.protocol.spec import RunSpec  # noqa: PLC0415

    target = f"{Path(__file__).with_name('lightning_train.py')}:main"
    spec = RunSpec(target=target, run_dir=str(tmp_path / "run"), threads_per_rank=1)
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary["ranks"]
    result = summary["ranks"][0]["result"]
    assert result["finite"] and result["global_step"] > STEPS  # the undone steps trained again
    assert summary["steps_completed"] == STEPS
    assert summary["steps_executed"] == result["global_step"]
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    assert {"rollback", "shrink_lr"} <= {
        d["action"] for d in decisions if d["outcome"] == "applied"
    }


@pytest.mark.slow
@pytest.mark.ray
def test_a_lost_rank_under_lightning_restarts_every_rank_and_settles_the_pending_rollback(
    ray_cluster: None, tmp_path: Path
) -> None:
    """2 ranks under Lightning's DDP; rank 1 is SIGKILLed at step 15, right after the NaN of
    step 14, before its rollback reaches a boundary. Lightning's process group is the
    framework's: the survivor says it never re-forms it (`regroups` False) and is replaced at
    once, not after a grace, so `restart_rank` restarts every rank from the start of the
    training function (no checkpoint under the callbacks). The restart ran the NaN's step
    again, so the pending rollback is settled by it, not sent to the new ranks; its
    shrink_lr is. The NaN that comes again in the new processes is a new incident, decided
    anew (the policy's cooldown holds it back, and says so), and the run completes."""
    from remedy.cli.runner import run_supervised  # noqa: PLC0415
    from remedy.control import restart  # noqa: PLC0415 - Ray side, only here
    from remedy.protocol.spec import RunSpec  # noqa: PLC0415

    target = f"{Path(__file__).with_name('lightning_train.py')}:main"
    run = tmp_path / "run"
    kill = {"kind": "kill_rank", "at_step": NAN_AT_BATCH, "rank": 1}
    spec = RunSpec(target=target, run_dir=str(run), workers=2, spares=2, faults=[kill],
                   threads_per_rank=1)  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary["ranks"]
    assert summary["steps_completed"] == STEPS
    assert [r["incarnation"] for r in summary["ranks"]] == [2, 2]
    assert all(r["result"]["finite"] for r in summary["ranks"])
    decisions = read_jsonl(run / "decisions.jsonl")
    [restart_rank] = [d for d in decisions if d["action"] == "restart_rank"]
    assert restart_rank["outcome"] == "applied"
    assert restart_rank["detail"].startswith(f"no targeted restart: {restart.NONE_CAN_REGROUP}")
    history = read_jsonl(run / "history.jsonl")
    lost = [
        r["reason"] for r in history if r.get("type") == "job_state" and r["input"] == "RanksLost"
    ]
    assert lost[-1].startswith(restart.FRAMEWORK_LOOP), lost
    nan = [d for d in decisions if d["anomaly"]["kind"] == "nonfinite_loss"]
    assert [(d["action"], d["outcome"]) for d in nan] == [
        ("rollback", "applied"), ("shrink_lr", "applied"), ("rollback", "suppressed"),
    ], nan  # fmt: skip
    assert nan[0]["detail"].startswith("carried out by the full-group restart"), nan[0]
    assert "cooling down" in nan[2]["reason"], nan[2]
