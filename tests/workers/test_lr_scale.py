"""shrink_lr holds under every LR scheduler of torch and a hand-written schedule, and across a rollback."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as lrs

from remedy.rank import Command, Guard, GuardConfig
from remedy.rank.actions.lr_scale import LRScale

# Tiny models: one intra-op thread (faster on 2 loaded cores; comparisons stay in-process).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

_ids = itertools.count()

Sched = Callable[[torch.optim.Optimizer], Any]

SCHEDULERS: dict[str, Sched] = {
    "LambdaLR": lambda o: lrs.LambdaLR(o, lambda s: 1.0 / (1 + 0.3 * s)),
    "MultiplicativeLR": lambda o: lrs.MultiplicativeLR(o, lambda s: 0.93),
    "StepLR": lambda o: lrs.StepLR(o, step_size=5, gamma=0.5),
    "MultiStepLR": lambda o: lrs.MultiStepLR(o, milestones=[6, 13], gamma=0.3),
    "ExponentialLR": lambda o: lrs.ExponentialLR(o, gamma=0.9),
    "LinearLR": lambda o: lrs.LinearLR(o, start_factor=0.2, total_iters=15),
    "ConstantLR": lambda o: lrs.ConstantLR(o, factor=0.5, total_iters=12),
    "PolynomialLR": lambda o: lrs.PolynomialLR(o, total_iters=30, power=2.0),
    "OneCycleLR": lambda o: lrs.OneCycleLR(o, max_lr=0.1, total_steps=40),
    "CosineAnnealingLR": lambda o: lrs.CosineAnnealingLR(o, T_max=10, eta_min=0.001),
    "CosineAnnealingWarmRestarts": lambda o: lrs.CosineAnnealingWarmRestarts(o, T_0=6),
    "CyclicLR": lambda o: lrs.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=4),
    "SequentialLR": lambda o: lrs.SequentialLR(
        o, [lrs.LinearLR(o, start_factor=0.1, total_iters=5), lrs.ExponentialLR(o, 0.9)], [5]
    ),
    "ChainedScheduler": lambda o: lrs.ChainedScheduler(
        [lrs.ConstantLR(o, factor=0.5, total_iters=9), lrs.ExponentialLR(o, gamma=0.9)]
    ),
    # The loss below never improves, so the plateau scheduler cuts every third step.
    "ReduceLROnPlateau": lambda o: lrs.ReduceLROnPlateau(o, patience=2, factor=0.5),
    "hand-written": lambda o: None,  # the loop sets group["lr"] itself before every step
}


def hand_written_lr(step: int) -> float:
    return 0.1 * 0.7 ** (step // 3) + 0.001 * step


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    # A constant loss: the same loss stream in both twins, whatever their LR (ReduceLROnPlateau).
    return (model(batch) * 0.0).sum() + 1.0


def run(
    name: str, steps: int, cut_at: int | None, rollback_at: int | None = None
) -> list[tuple[int, float]]:
    """Train `steps` steps; (logical step, LR the optimizer applied) at every optimizer step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = SCHEDULERS[name](opt)
    guard = Guard(
        model, opt, loss_fn=loss_fn, data=lambda i: torch.ones(2, 4), max_steps=steps,
        scheduler=sched, config=GuardConfig(detectors=[], snapshot_every=5),
    )  # fmt: skip
    applied: list[tuple[int, float]] = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: applied.append((guard.step_count, float(o.param_groups[0]["lr"])))
    )
    for batch in guard:
        if name == "hand-written":
            for group in opt.param_groups:
                group["lr"] = hand_written_lr(guard.step_count)
        if guard.tick == cut_at:
            guard.submit(Command(f"cut-{next(_ids)}", "shrink_lr", {"factor": 0.3}, 0, 0))
        if guard.tick == rollback_at:
            guard.submit(
                Command(f"rb-{next(_ids)}", "rollback", {"steps_back": 9}, 0, guard.step_count)
            )
        guard.step(batch)
    guard.close()
    return applied


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_shrink_lr_holds_under_every_schedule(name: str) -> None:
    """After shrink_lr(0.3) at step 8 the LR the optimizer applies at every later step is exactly
    0.3x what an unshrunk twin applies at that step (the schedule itself keeps its shape)."""
    twin = dict(run(name, 30, cut_at=None))
    cut = run(name, 30, cut_at=8)
    assert [lr for s, lr in cut[:8]] == [twin[s] for s in range(8)]
    later = cut[9:]  # the command is taken at the boundary before step 9
    assert len(later) == 21
    assert [lr for _, lr in later] == [0.3 * twin[s] for s, _ in later]
    assert len({lr for _, lr in later}) > 1, "the schedule should move the LR in this window"


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_shrink_lr_survives_a_rollback_to_before_the_cut(name: str) -> None:
    """A rollback after step 14 to the snapshot of step 5, taken before the cut at step 8, replays
    the schedule from step 5 with the cut still in force: 0.3x the twin's LR at each step."""
    twin = dict(run(name, 30, cut_at=None))
    cut = run(name, 30, cut_at=8, rollback_at=14)
    steps = [s for s, _ in cut]
    assert steps[:16] == [*range(15), 5], steps  # taken before step 15: back to step 5
    replay = cut[15:]
    assert [lr for _, lr in replay] == [0.3 * twin[s] for s, _ in replay]


def test_cut_never_goes_below_min_lr_nor_raises_a_smaller_scheduled_lr() -> None:
    """The floor keeps a cut LR at min_lr, and a scheduled LR already below min_lr stays as it is."""
    cut = LRScale()
    cut.cut(0.01, min_lr=1e-3)
    assert cut.effective(0.05) == 1e-3
    assert cut.effective(1e-4) == 1e-4
    assert cut.effective(0.5) == pytest.approx(5e-3)
