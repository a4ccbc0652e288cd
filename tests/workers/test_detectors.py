"""Detectors fire on the fault they target and stay silent on clean numbers."""

from __future__ import annotations

import math
import random

import pytest

from workers.detectors import GradNormDetector, LossSpikeDetector, NonFiniteDetector
from workers.stats import StepStats


def stats(step: int, *, loss: float = 2.0, grad_norm: float = 1.0, **kw: object) -> StepStats:
    return StepStats(
        step=step,
        tick=step,
        rank=0,
        loss=loss,
        grad_norm=grad_norm,
        lr=1e-3,
        step_time_s=0.01,
        loader_time_s=0.0,
        batch_index=step,
        **kw,  # type: ignore[arg-type]
    )


def clean_losses(n: int, seed: int = 0) -> list[float]:
    """A decaying, noisy loss curve like a healthy run's."""
    rng = random.Random(seed)
    return [1.5 + 2.5 * math.exp(-i / 80) + rng.gauss(0, 0.04) for i in range(n)]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_loss_fires(bad: float) -> None:
    """A NaN or infinite loss is a critical nonfinite_loss event."""
    (ev,) = NonFiniteDetector().observe(stats(7, loss=bad))
    assert (ev.kind, ev.step, ev.severity) == ("nonfinite_loss", 7, "critical")


def test_nonfinite_grad_names_parameter() -> None:
    """A non-finite gradient norm with a finite loss is nonfinite_grad, naming the parameter."""
    (ev,) = NonFiniteDetector().observe(
        stats(3, grad_norm=math.nan, extra={"nonfinite_param": "blocks.0.attn.qkv.weight"})
    )
    assert ev.kind == "nonfinite_grad"
    assert ev.details["param"] == "blocks.0.attn.qkv.weight"


def test_nonfinite_grad_ignored_when_scaler_skipped() -> None:
    """Inf gradients under a GradScaler are its overflow signal, not nonfinite_grad."""
    assert NonFiniteDetector().observe(stats(3, grad_norm=math.inf, scaler_skipped=True)) == []


def test_nonfinite_silent_on_clean() -> None:
    """Finite losses and norms raise nothing."""
    det = NonFiniteDetector()
    assert [e for i, x in enumerate(clean_losses(500)) for e in det.observe(stats(i, loss=x))] == []


def test_grad_norm_explosion_fires_above_threshold() -> None:
    """A norm above 1e4 (the default) is grad_norm_explosion with the threshold recorded."""
    det = GradNormDetector()
    assert det.observe(stats(1, grad_norm=9e3)) == []
    (ev,) = det.observe(stats(2, grad_norm=2e4))
    assert (ev.kind, ev.value, ev.threshold) == ("grad_norm_explosion", 2e4, 1e4)


def test_grad_norm_vanishing_needs_patience() -> None:
    """A tiny norm must persist for `vanish_patience` steps before grad_norm_vanishing fires."""
    det = GradNormDetector(vanish_patience=3)
    got = [det.observe(stats(i, grad_norm=1e-8)) for i in range(3)]
    assert got[0] == [] and got[1] == []
    assert got[2][0].kind == "grad_norm_vanishing"
    assert det.observe(stats(4, grad_norm=0.5)) == []


def test_loss_spike_fires_on_spike() -> None:
    """A loss far above the rolling median is a loss_spike at that step."""
    det = LossSpikeDetector()
    losses = clean_losses(120)
    events = [e for i, x in enumerate(losses) for e in det.observe(stats(i, loss=x))]
    assert events == []
    (ev,) = det.observe(stats(120, loss=losses[-1] * 5))
    assert ev.kind == "loss_spike" and ev.step == 120
    assert ev.value is not None and ev.threshold is not None and ev.value > ev.threshold


def test_loss_spike_silent_on_clean_runs() -> None:
    """No spike is reported on 2000 steps of clean, noisy, decaying loss (several seeds)."""
    for seed in range(5):
        det = LossSpikeDetector()
        events = [
            e for i, x in enumerate(clean_losses(2000, seed)) for e in det.observe(stats(i, loss=x))
        ]
        assert events == [], f"seed {seed}: {events[:2]}"


def test_loss_spike_ignores_drops_and_warmup() -> None:
    """Falling losses and the first `min_history` steps never fire."""
    det = LossSpikeDetector(min_history=20)
    assert [
        e for i in range(19) for e in det.observe(stats(i, loss=100.0 if i == 10 else 2.0))
    ] == []
    assert [e for i in range(19, 60) for e in det.observe(stats(i, loss=2.0 / (i - 17)))] == []


def test_loss_spike_reset_forgets_window() -> None:
    """After reset (a rollback), the detector needs a fresh history before firing."""
    det = LossSpikeDetector()
    for i, x in enumerate(clean_losses(60)):
        det.observe(stats(i, loss=x))
    det.reset()
    assert det.observe(stats(61, loss=50.0)) == []
