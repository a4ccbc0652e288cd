"""Loss divergence and oscillation fire on real runs that go wrong and stay quiet on clean ones."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank.detectors import LossDivergenceDetector, LossOscillationDetector
from remedy.rank.detectors.testing import feed, run_guarded, step_stats

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


def clean_losses(n: int, seed: int = 0) -> list[float]:
    """A decaying, noisy loss curve like a healthy run's."""
    rng = random.Random(seed)
    return [1.5 + 2.5 * math.exp(-i / 80) + rng.gauss(0, 0.04) for i in range(n)]


def tiny() -> tuple[GPT, SyntheticCorpus]:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=64, block_size=32)), SyntheticCorpus(
        block_size=32, batch_size=8
    )


@pytest.mark.parametrize("seed", range(5))
def test_trend_detectors_silent_on_clean_curves(seed: int) -> None:
    """Neither detector fires on 2000 steps of a clean, noisy, decaying loss."""
    losses = clean_losses(2000, seed)
    stream = [step_stats(i, loss=x) for i, x in enumerate(losses)]
    assert feed(LossDivergenceDetector(), stream) == []
    assert feed(LossOscillationDetector(), stream) == []


def test_divergence_fires_on_slow_creep() -> None:
    """A loss creeping up 0.2% per step for 300 steps is loss_divergence, well inside the run."""
    losses = [1.0 + 0.01 * math.sin(i) for i in range(200)]
    losses += [losses[-1] * (1.002 ** (i + 1)) for i in range(300)]
    events = feed(LossDivergenceDetector(), [step_stats(i, loss=x) for i, x in enumerate(losses)])
    assert events, "no divergence reported"
    assert events[0].kind == "loss_divergence" and 200 < events[0].step < 500
    assert events[0].value is not None and events[0].threshold is not None
    assert events[0].value > events[0].threshold


def test_divergence_ignores_isolated_spikes() -> None:
    """Two spiking batches in a block do not move its median: no divergence."""
    losses = [1.0 + 0.01 * math.sin(i) for i in range(600)]
    for i in (250, 251, 400):
        losses[i] = 20.0
    assert (
        feed(LossDivergenceDetector(), [step_stats(i, loss=x) for i, x in enumerate(losses)]) == []
    )


def test_divergence_on_real_learning_rate_blowup(tmp_path: Path) -> None:
    """A real run whose LR jumps tenfold at step 300 diverges; reported within one window."""
    model, corpus = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 10.0 if s >= 299 else 1.0)
    det = LossDivergenceDetector()
    run = run_guarded(
        model, opt, loss_fn=lm_loss, data=corpus.batch, steps=480, scheduler=sched,
        detectors=[det], policy_dir=tmp_path,
    )  # fmt: skip
    ev = run.first("loss_divergence")
    assert ev is not None, run.kinds()
    assert 300 < ev.step <= 300 + det.block * det.window_blocks
    assert all(e.step > 300 for e in run.events)


def test_oscillation_on_real_garbage_source(tmp_path: Path) -> None:
    """From step 300 every other batch is garbage (random tokens, as from a source tokenized with
    the wrong vocabulary): the loss swings with no progress and loss_oscillation fires."""
    model, corpus = tiny()
    gen = torch.Generator().manual_seed(1)
    garbage = [torch.randint(0, 64, (8, 33), generator=gen) for _ in range(200)]

    def batch(i: int) -> torch.Tensor:
        return garbage[(i // 2) % 200] if i >= 300 and i % 2 else corpus.batch(i)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    det = LossOscillationDetector()
    run = run_guarded(
        model, opt, loss_fn=lm_loss, data=batch, steps=480, detectors=[det], policy_dir=tmp_path
    )
    ev = run.first("loss_oscillation")
    assert ev is not None, run.kinds()
    assert 300 < ev.step <= 300 + det.block * (det.window_blocks + det.patience)
    assert ev.value is not None and ev.value > det.spread_rel


def test_oscillation_not_confused_with_level_shift() -> None:
    """A jump to a new, calm level is not oscillation (divergence covers it)."""
    losses = [1.0 + 0.02 * math.sin(i) for i in range(300)] + [
        3.0 + 0.02 * math.sin(i) for i in range(300)
    ]
    stream = [step_stats(i, loss=x) for i, x in enumerate(losses)]
    assert feed(LossOscillationDetector(), stream) == []
    assert [e.kind for e in feed(LossDivergenceDetector(), stream)] == ["loss_divergence"]


def test_reset_clears_windows() -> None:
    """After a rollback a full window must refill before either detector can fire again."""
    det = LossDivergenceDetector()
    feed(det, [step_stats(i, loss=1.0 + 0.004 * i) for i in range(180)])
    det.reset()
    events = feed(det, [step_stats(200 + i, loss=5.0 + 0.01 * i) for i in range(det.block * 4)])
    assert events == []


def test_nonfinite_losses_are_skipped() -> None:
    """NaN losses never enter a block (the numerics detector owns them)."""
    stream = [step_stats(i, loss=math.nan if i % 3 == 0 else 1.0) for i in range(600)]
    assert feed(LossOscillationDetector(), stream) == []
    assert feed(LossDivergenceDetector(), stream) == []


def noisy_regression_losses(steps: int, seed: int = 1) -> list[float]:
    """Real per-step losses of a small MLP regression that learns slowly, with batch-32 noise of
    20-25% of the loss: block medians wander by ~7% with no trend (examples/loops/amp_mlp.py in
    full precision)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(4000 + seed)
    x = torch.randn(4096, 16, generator=gen)
    y = torch.sin(x @ torch.randn(16, 4, generator=gen)).sum(1, keepdim=True)
    y += 0.1 * torch.randn(4096, 1, generator=gen)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 4096, (32,), generator=gen)
        loss = torch.nn.functional.mse_loss(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trend_detectors_silent_on_a_real_noisy_small_job(seed: int) -> None:
    """1200 steps of a real noisy small job whose batch losses scatter by 20-25% of the level for
    ever: that scatter is the job's, not oscillation, and block medians 15-25% apart with no
    trend are noise, not divergence."""
    stream = [step_stats(i, loss=x) for i, x in enumerate(noisy_regression_losses(1200, seed))]
    assert [(e.step, e.value) for e in feed(LossOscillationDetector(), stream)] == []
    assert [(e.step, e.value) for e in feed(LossDivergenceDetector(), stream)] == []


def test_oscillation_keeps_its_reference_while_it_fires() -> None:
    """Windows judged oscillating do not raise the reference scatter: a source that stays garbage
    is reported again after the cooldown."""
    rng = random.Random(0)
    losses = [2.0 + rng.gauss(0, 0.05) for _ in range(300)]
    losses += [2.0 + (2.0 if i % 2 else 0.0) + rng.gauss(0, 0.05) for i in range(700)]
    events = feed(LossOscillationDetector(), [step_stats(i, loss=x) for i, x in enumerate(losses)])
    assert len(events) >= 2 and all(e.step > 300 for e in events)
