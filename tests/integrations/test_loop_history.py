"""Under the callbacks' LoopGuard, a rollback restores the detectors' histories and dropped updates stay out."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from remedy.integrations._loop import LoopGuard
from remedy.rank.detectors import GradNormDetector, LossSpikeDetector


def _step(guard: LoopGuard, g: torch.Generator) -> None:
    """One step of a framework's loop, driven through the LoopGuard's hooks."""
    guard.begin_step()
    x = torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(guard.model(x), x.sum(1, keepdim=True))
    guard.record_loss(loss)
    loss.backward()
    guard.before_optimizer_step()
    guard.optimizer.step()
    guard.optimizer.zero_grad(set_to_none=True)
    guard.end_step()


def test_a_rollback_restores_the_histories_and_dropped_updates_never_join_the_baseline(
    tmp_path: Path,
) -> None:
    """Rollback from step 35 to 30: the norm and loss windows are step 30's; then 10 dropped
    batches (skip_batches) leave the norm window as it was, and the next update joins it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    norms, losses = GradNormDetector(), LossSpikeDetector()
    guard = LoopGuard(model, detectors=[norms, losses], run_dir=tmp_path, snapshot_every=10)
    guard.attach(torch.optim.SGD(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(0)
    for _ in range(35):
        _step(guard, g)
    snap = guard.snapshots.newest_at_or_before(30)
    assert snap is not None and snap.step == 30 and snap.detectors is not None
    assert len(snap.detectors["grad_norm"]["norms"]) == 30
    assert guard.detectors.state_dict() != snap.detectors

    guard.restore(snap)
    assert guard.detectors.state_dict() == snap.detectors
    restored = norms.state_dict()["norms"]
    guard.skip_next(10)
    for _ in range(10):
        _step(guard, g)
    assert norms.state_dict()["norms"] == restored, "dropped updates join no baseline"
    assert len(losses.state_dict()["losses"]) == 40, "their losses are still losses seen"
    _step(guard, g)
    assert norms.state_dict()["norms"][:-1] == restored
    guard.close()
