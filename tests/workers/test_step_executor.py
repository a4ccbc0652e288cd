"""The step's arithmetic on its own: micro-batches, clipping, the host read and the update rule."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from remedy.rank.actions.remediation import Remediation
from remedy.rank.chaos.faults import FaultInjector
from remedy.rank.loop.step_executor import StepExecutor, StepSettings, split

# Tiny models: one intra-op thread (faster on 2 loaded cores; comparisons stay in-process).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _executor(
    *,
    micro_batches: int = 1,
    scheduler: Any = None,
    scaler: torch.amp.GradScaler | None = None,
    settings: StepSettings | None = None,
    seed: int = 0,
) -> StepExecutor:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if callable(scheduler):
        scheduler = scheduler(opt)
    return StepExecutor(
        model,
        opt,
        loss_fn=_mse,
        scheduler=scheduler,
        scaler=scaler,
        settings=settings or StepSettings(),
        remediation=Remediation(micro_batches=micro_batches),
        injector=FaultInjector([], 0),
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _grads(ex: StepExecutor) -> list[torch.Tensor]:
    return [p.grad.clone() for p in ex.params if p.grad is not None]


def test_micro_batches_give_the_full_batchs_loss_and_gradients() -> None:
    """Split 4 ways with each chunk's loss weighted by its share: the same loss and gradients."""
    whole, parts = _executor(), _executor(micro_batches=4)
    loss_w = whole.forward_backward(_batch(), 0)
    loss_p = parts.forward_backward(_batch(), 0)
    assert torch.allclose(loss_w, loss_p)
    for a, b in zip(_grads(whole), _grads(parts), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert parts.remediation.max_micro_batches == 8  # the batch's size: no split past it


def test_clipping_scales_gradients_to_the_bound_and_returns_the_norm_before() -> None:
    ex = _executor(settings=StepSettings(grad_clip=1e-3))
    ex.forward_backward(_batch(), 0)
    raw = math.sqrt(sum(float(g.pow(2).sum()) for g in _grads(ex)))
    norm = float(ex.finish_grads(0))
    assert norm == pytest.approx(raw, rel=1e-5)
    clipped = math.sqrt(sum(float(g.pow(2).sum()) for g in _grads(ex)))
    assert clipped == pytest.approx(1e-3, rel=1e-3)


def test_read_brings_loss_norm_and_number_to_the_host() -> None:
    loss, norm, seq = torch.tensor(2.5), torch.tensor(3.0), torch.tensor(7)
    assert StepExecutor.read(loss, norm, seq) == (2.5, 3.0, 7)
    assert StepExecutor.read(loss, norm, None) == (2.5, 3.0, None)


def test_read_all_brings_every_extra_tensor_in_one_read() -> None:
    """Extra tensors of any length (the agreement's seq, the phases' exchange) come back as lists
    in order, a None as None."""
    loss, norm = torch.tensor(2.5), torch.tensor(3.0)
    extras = [torch.tensor([7]), None, torch.tensor([3000, 1])]
    assert StepExecutor.read_all(loss, norm, extras) == (2.5, 3.0, [[7], None, [3000, 1]])


@pytest.mark.parametrize(("loss", "norm"), [(math.nan, 1.0), (1.0, math.inf)])
def test_a_non_finite_value_skips_the_update_and_the_scheduler(loss: float, norm: float) -> None:
    ex = _executor(scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    ex.forward_backward(_batch(), 0)
    before = [p.detach().clone() for p in ex.params]
    assert ex.optimizer_step(loss, norm) is True
    assert all(torch.equal(a, b) for a, b in zip(before, ex.params, strict=True))
    assert ex.optimizer.param_groups[0]["lr"] == 0.1  # the scheduler did not step either


def test_an_update_applies_the_lr_cut_only_while_it_runs_and_steps_the_scheduler() -> None:
    """A cut to 0 leaves the weights; the optimizer's own LR is as it was; the scheduler stepped."""
    ex = _executor(scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    ex.remediation.lr_cut.cut(0.0)
    ex.forward_backward(_batch(), 0)
    ex.finish_grads(0)
    before = [p.detach().clone() for p in ex.params]
    assert ex.optimizer_step(1.0, 1.0) is False
    assert all(torch.equal(a, b) for a, b in zip(before, ex.params, strict=True))
    assert ex.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_plateau_schedulers_get_the_training_loss() -> None:
    ex = _executor(
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    )
    for loss in (1.0, 2.0, 3.0):
        ex.forward_backward(_batch(), 0)
        ex.optimizer_step(loss, 1.0)
    assert ex.optimizer.param_groups[0]["lr"] < 0.1  # worse twice in a row: reduced


def test_a_scaled_nan_loss_is_skipped_and_the_scaler_backs_off() -> None:
    """The scaler checks gradients only: a NaN loss is skipped by the executor and still
    moves the scaler on."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ex = _executor(scaler=scaler)
    ex.forward_backward(_batch(), 0)
    ex.finish_grads(0)
    assert ex.scaled and ex.optimizer_step(math.nan, 1.0) is True
    assert all(p.grad is None for p in ex.params)


def test_split_keeps_each_batch_shape_and_weighs_uneven_chunks() -> None:
    x = torch.arange(10).reshape(5, 2)
    chunks = split({"x": x, "y": x + 1}, 2)
    assert [c["x"].shape[0] for c, _ in chunks] == [3, 2]
    assert [w for _, w in chunks] == [0.6, 0.4]
    assert split(x, 1) == [(x, 1.0)]
    with pytest.raises(TypeError, match="cannot split a str batch"):
        split("text", 2)
