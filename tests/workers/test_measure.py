"""Per-step measurements: the global gradient norm and memory in use."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from remedy.rank.loop.measure import GradNorm, MemoryProbe, first_nonfinite_param


def _model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model(torch.randn(5, 8)).pow(2).sum().backward()
    return model


def test_grad_norm_matches_torch_total_norm() -> None:
    """Same number as torch's own clip_grad_norm_ (which returns the total norm)."""
    model = _model_with_grads()
    params = list(model.parameters())
    expected = nn.utils.clip_grad_norm_(params, math.inf)
    assert GradNorm(params)().item() == pytest.approx(expected.item(), rel=1e-6)


def test_grad_norm_groups_dtypes_and_skips_missing_grads() -> None:
    """Mixed dtypes are normed per group and combined; parameters without a gradient count 0;
    large fp16 gradients are summed in float32 and stay finite."""
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    c = nn.Parameter(torch.zeros(4))  # never gets a gradient
    a.grad = torch.tensor([3.0, 0.0, 4.0])
    b.grad = torch.tensor([6e4, 6e4], dtype=torch.float16)
    norm = GradNorm([a, b, c])
    expected = math.sqrt(25 + 2 * 6e4**2)
    assert norm().item() == pytest.approx(expected, rel=1e-3)
    a.grad = None
    b.grad = None
    assert norm().item() == 0.0


def test_grad_norm_sees_a_single_nan_and_the_search_names_it() -> None:
    """One NaN element anywhere makes the norm NaN; the search after detection names it."""
    model = _model_with_grads()
    norm = GradNorm(model.parameters())
    assert math.isfinite(norm().item())
    model[2].weight.grad[1, 3] = float("nan")
    assert math.isnan(norm().item())
    assert first_nonfinite_param(model) == "2.weight"


def test_grad_norm_follows_new_gradient_tensors() -> None:
    """zero_grad(set_to_none=True) replaces the gradient tensors each step: still counted."""
    model = _model_with_grads()
    params = list(model.parameters())
    norm = GradNorm(params)
    first = norm().item()
    model.zero_grad(set_to_none=True)
    model(torch.randn(5, 8)).pow(2).sum().mul(3).backward()
    assert norm().item() == pytest.approx(nn.utils.clip_grad_norm_(params, math.inf).item())
    assert norm().item() != pytest.approx(first)


def test_memory_probe_reads_rss_at_most_once_per_interval() -> None:
    """Within the interval the last reading comes back; with no interval every call reads."""
    slow = MemoryProbe(torch.device("cpu"), min_interval_s=3600.0)
    fast = MemoryProbe(torch.device("cpu"), min_interval_s=0.0)
    before, reserved, capacity = slow.read()
    assert isinstance(before, int) and before > 0
    assert reserved is None and capacity is None
    fast_before = fast.read()[0]
    assert fast_before is not None
    grow = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert slow.read()[0] == before
    after = fast.read()[0]
    assert after is not None and after - fast_before >= 48 << 20
    del grow
