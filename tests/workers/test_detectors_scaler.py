"""Scaler detectors against real fp16 GradScaler runs on CPU: storms and collapse fire, a healthy
scaler finding its scale does not."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from remedy.rank.detectors import ScalerCollapseDetector, ScalerOverflowDetector
from remedy.rank.detectors.testing import feed, run_guarded, step_stats

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def batches(n: int = 64, *, nan_from: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Regression batches; from batch `nan_from` on the targets are NaN (a corrupt label file)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.randn(16, 32, generator=gen)
        y = x[:, :1] * 2 + 1
        out.append((x, y * math.nan if nan_from is not None and i >= nan_from else y))
    return out


def fp16_run(
    tmp_path: Path, scaler: torch.amp.GradScaler, steps: int, *, nan_from: int | None = None
) -> tuple[list[str], list[int], list[float]]:
    model = net()
    data = batches(nan_from=nan_from)
    run = run_guarded(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-2),
        loss_fn=mse,
        data=lambda i: data[min(i, len(data) - 1)],
        steps=steps,
        scaler=scaler,
        amp_dtype=torch.float16,
        detectors=[ScalerOverflowDetector(), ScalerCollapseDetector()],
        policy_dir=tmp_path,
    )
    scales = [s.loss_scale for s in run.stats if s.loss_scale is not None]
    return [e.kind for e in run.events], [e.step for e in run.events], scales


def test_overflow_storm_from_real_scaler(tmp_path: Path) -> None:
    """Init scale 2**40 with growth every 2 steps: the scaler keeps overflowing; scaler_overflow."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=2)
    kinds, steps, scales = fp16_run(tmp_path, scaler, 120)
    assert scales[0] < 2.0**40  # a real overflow backed the scale off
    assert kinds[:1] == ["scaler_overflow"]
    assert steps[0] < 60
    assert "scaler_collapse" not in kinds


def test_collapse_from_real_persistent_nan(tmp_path: Path) -> None:
    """NaN targets from batch 5 on: every backward is non-finite, the real scaler halves its
    scale each step, and scaler_collapse (critical) fires the step it falls below 1."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    kinds, steps, scales = fp16_run(tmp_path, scaler, 30, nan_from=5)
    assert min(scales) < 1.0
    assert kinds.count("scaler_collapse") == 1
    collapse = steps[kinds.index("scaler_collapse")]
    assert collapse == next(i for i, s in enumerate(scales) if s < 1.0)


def test_healthy_scaler_is_silent(tmp_path: Path) -> None:
    """A default scaler backs off a few times to find its scale, then trains: no event."""
    scaler = torch.amp.GradScaler("cpu")
    kinds, _, scales = fp16_run(tmp_path, scaler, 300)
    assert kinds == []
    assert min(scales) >= 1.0


def test_no_scaler_no_events() -> None:
    """Without a scaler (loss_scale None) both detectors are silent, skips or not."""
    stream = [step_stats(i, scaler_skipped=True) for i in range(200)]
    assert feed(ScalerOverflowDetector(), stream) == []
    assert feed(ScalerCollapseDetector(), stream) == []


@pytest.mark.parametrize(("skips", "fires"), [(25, False), (26, True)])
def test_overflow_rate_is_over_full_window(skips: int, fires: bool) -> None:
    """More than 25% of the last 100 steps must be skips: 25 do not fire, 26 do."""
    stream = [
        step_stats(i, loss_scale=1024.0, scaler_skipped=i < skips)
        for i in range(100)  # skips come first
    ]
    stream.append(step_stats(100, loss_scale=512.0, scaler_skipped=True))  # the window slides
    events = feed(ScalerOverflowDetector(), stream)
    assert [e.step for e in events] == ([skips - 1] if fires else [])


def test_collapse_rearms_after_recovery() -> None:
    """A collapse is reported on crossing the floor; after recovering, a new collapse is news."""
    scales = [4.0, 0.5, 0.25, 0.5, 2.0, 0.5]
    events = feed(
        ScalerCollapseDetector(), [step_stats(i, loss_scale=s) for i, s in enumerate(scales)]
    )
    assert [(e.step, e.severity) for e in events] == [(1, "critical"), (5, "critical")]
