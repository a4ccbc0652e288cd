"""update_stall fires when real training stops moving the weights, and only then."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank.detectors import UpdateStallDetector
from remedy.rank.detectors.testing import feed, run_guarded, step_stats

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


def tiny() -> tuple[GPT, SyntheticCorpus]:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=64, block_size=32)), SyntheticCorpus(
        block_size=32, batch_size=8
    )


def test_stall_on_real_zero_learning_rate(tmp_path: Path) -> None:
    """A scheduler that drops the LR to zero at step 100 stalls the weights: reported ~60 steps on."""
    model, corpus = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s >= 99 else 1.0)
    det = UpdateStallDetector(model)
    run = run_guarded(
        model, opt, loss_fn=lm_loss, data=corpus.batch, steps=200, scheduler=sched,
        detectors=[det], policy_dir=tmp_path,
    )  # fmt: skip
    (ev,) = run.events
    assert ev.kind == "update_stall"
    assert 100 + det.every * det.patience <= ev.step <= 100 + det.every * (det.patience + 2)
    assert ev.value == 0.0 and ev.details["lr"] == 0.0


def test_silent_on_real_training(tmp_path: Path) -> None:
    """Healthy training with a decaying LR moves the weights at every read: no event."""
    model, corpus = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.05, 1 - s / 300))
    run = run_guarded(
        model, opt, loss_fn=lm_loss, data=corpus.batch, steps=300, scheduler=sched,
        detectors=[UpdateStallDetector(model)], policy_dir=tmp_path,
    )  # fmt: skip
    assert run.events == []


def test_sample_is_fixed_and_sized() -> None:
    """The watched elements are drawn once: `sample_size` of them, only from trainable tensors."""
    model, _ = tiny()
    model.pos_emb.weight.requires_grad_(False)
    det = UpdateStallDetector(model, sample_size=512)
    assert sum(len(idx) for _, idx in det._picks) == 512
    assert all(p.requires_grad for p, _ in det._picks)
    assert all(p is not model.pos_emb.weight for p, _ in det._picks)


def test_unattached_is_silent_until_attached() -> None:
    """Without a model the detector does nothing; `attach` switches it on."""
    det = UpdateStallDetector(patience=2, every=1)
    assert feed(det, [step_stats(i) for i in range(10)]) == []
    model, _ = tiny()
    det.attach(model)
    events = feed(det, [step_stats(i) for i in range(10, 14)])
    assert [e.kind for e in events] == ["update_stall"]


def test_reset_restarts_comparison() -> None:
    """After a rollback the weights jumped back: the next read is a new baseline, not a change."""
    model, _ = tiny()
    det = UpdateStallDetector(model, every=1, patience=3)
    feed(det, [step_stats(i) for i in range(3)])  # two stalled reads
    det.reset()
    assert feed(det, [step_stats(i) for i in range(3, 6)]) == []  # one baseline + two stalls
    assert [e.kind for e in feed(det, [step_stats(6)])] == ["update_stall"]


def test_tiny_changes_below_threshold_count_as_stall() -> None:
    """Changes far below `min_rel_change` (updates rounded away) are a stall; larger ones are not."""
    model, _ = tiny()
    det = UpdateStallDetector(model, every=1, patience=3)
    events = []
    for i in range(6):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-9)
        events += det.observe(step_stats(i))
    assert [e.kind for e in events] == ["update_stall"]
    det.reset()
    for i in range(6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        assert det.observe(step_stats(10 + i)) == []
