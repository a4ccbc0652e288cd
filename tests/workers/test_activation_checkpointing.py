"""Tests for workers.activation_checkpointing: wrapping in place, equality, saved bytes, the cap."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from examples.gpt_model import GPT, GPTConfig, lm_loss
from remedy.rank.actions.activation_checkpointing import (
    SavedActivationCap,
    SavedActivationMeter,
    checkpointed_modules,
    disable_activation_checkpointing,
    enable_activation_checkpointing,
)
from remedy.rank.actions.kv_cache import generate

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]

TINY = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=32)


@pytest.fixture
def tiny_model() -> GPT:
    """A seeded tiny GPT in training mode."""
    torch.manual_seed(0)
    return GPT(TINY)


@pytest.fixture
def batch() -> torch.Tensor:
    """One seeded (8, block_size + 1) token batch."""
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, TINY.vocab_size, (8, TINY.block_size + 1), generator=gen)


def loss_and_grads(model: nn.Module, batch: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss of one batch and a copy of every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def saved_bytes(model: nn.Module, batch: torch.Tensor) -> int:
    """Activation bytes saved for backward by one forward of `batch`."""
    with SavedActivationMeter() as meter:
        loss = lm_loss(model, batch)
    loss.backward()
    return meter.bytes


def test_default_wraps_every_block_in_place(tiny_model: GPT) -> None:
    """Enabling keeps parameter objects and state_dict keys, and reports the wrapped blocks."""
    params = [id(p) for p in tiny_model.parameters()]
    keys = list(tiny_model.state_dict())
    assert enable_activation_checkpointing(tiny_model) == ["blocks.0", "blocks.1"]
    assert [id(p) for p in tiny_model.parameters()] == params
    assert list(tiny_model.state_dict()) == keys
    assert checkpointed_modules(tiny_model) == ["blocks.0", "blocks.1"]


def test_optimizer_built_before_still_steps_the_parameters(
    tiny_model: GPT, batch: torch.Tensor
) -> None:
    """An optimizer built before enabling still holds and updates the model's parameters."""
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    enable_activation_checkpointing(tiny_model)
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    assert held == {id(p) for p in tiny_model.parameters()}
    before = [p.detach().clone() for p in tiny_model.parameters()]
    lm_loss(tiny_model, batch).backward()
    opt.step()
    after = list(tiny_model.parameters())
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))


def test_loss_and_gradients_match_without_checkpointing(
    tiny_model: GPT, batch: torch.Tensor
) -> None:
    """The same batch gives the same loss and gradients with and without checkpointing."""
    loss_plain, grads_plain = loss_and_grads(tiny_model, batch)
    enable_activation_checkpointing(tiny_model)
    loss_ckpt, grads_ckpt = loss_and_grads(tiny_model, batch)
    assert loss_ckpt == pytest.approx(loss_plain, abs=1e-6)
    assert grads_ckpt.keys() == grads_plain.keys()
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, atol=1e-6, rtol=0)


def test_checkpointing_cuts_saved_activation_bytes(tiny_model: GPT, batch: torch.Tensor) -> None:
    """Checkpointing all blocks saves far fewer bytes than none; half the blocks sits between."""
    none = saved_bytes(tiny_model, batch)
    enable_activation_checkpointing(tiny_model, fraction=0.5)
    half = saved_bytes(tiny_model, batch)
    enable_activation_checkpointing(tiny_model)
    every = saved_bytes(tiny_model, batch)
    print(f"\nsaved activation bytes per step: none={none} half={half} all={every}")
    assert every < 0.4 * none
    assert every < half < none


def test_disable_restores_the_original_forward(tiny_model: GPT, batch: torch.Tensor) -> None:
    """Disabling unwraps every module and brings saved bytes back to the baseline."""
    baseline = saved_bytes(tiny_model, batch)
    enable_activation_checkpointing(tiny_model)
    assert disable_activation_checkpointing(tiny_model) == ["blocks.0", "blocks.1"]
    assert checkpointed_modules(tiny_model) == []
    assert all("forward" not in m.__dict__ for m in tiny_model.modules())
    assert saved_bytes(tiny_model, batch) == baseline
    assert disable_activation_checkpointing(tiny_model) == []


def test_enable_is_idempotent(tiny_model: GPT, batch: torch.Tensor) -> None:
    """Enabling twice wraps each module once and saves the same bytes as enabling once."""
    first = enable_activation_checkpointing(tiny_model)
    once = saved_bytes(tiny_model, batch)
    assert enable_activation_checkpointing(tiny_model) == first
    assert saved_bytes(tiny_model, batch) == once
    disable_activation_checkpointing(tiny_model)
    assert checkpointed_modules(tiny_model) == []


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"modules": ["Block"]}, ["blocks.0", "blocks.1"]),
        ({"modules": ["CausalSelfAttention"]}, ["blocks.0.attn", "blocks.1.attn"]),
        ({"modules": ["blocks.1"]}, ["blocks.1"]),
        ({"pattern": "blocks.*"}, ["blocks.0", "blocks.1"]),
        ({"pattern": "blocks.*.mlp"}, ["blocks.0.mlp", "blocks.1.mlp"]),
        ({"modules": ["Sequential"], "pattern": "blocks.1.*"}, ["blocks.1.mlp"]),
        ({"fraction": 0.5}, ["blocks.0"]),
        ({"fraction": 0.0}, []),
        ({"pattern": "nothing*"}, []),
    ],
)
def test_selection(tiny_model: GPT, kwargs: dict[str, object], expected: list[str]) -> None:
    """Class names, qualified names, patterns and fractions select the outermost matches."""
    assert enable_activation_checkpointing(tiny_model, **kwargs) == expected  # type: ignore[arg-type]
    assert checkpointed_modules(tiny_model) == expected


def test_modules_inside_a_wrapped_one_are_not_wrapped_again(tiny_model: GPT) -> None:
    """After the blocks are wrapped, asking for their attention wraps nothing more."""
    enable_activation_checkpointing(tiny_model)
    assert enable_activation_checkpointing(tiny_model, modules=["CausalSelfAttention"]) == []
    assert checkpointed_modules(tiny_model) == ["blocks.0", "blocks.1"]


def test_fraction_out_of_range_is_refused(tiny_model: GPT) -> None:
    """A fraction outside [0, 1] raises."""
    with pytest.raises(ValueError, match="fraction"):
        enable_activation_checkpointing(tiny_model, fraction=1.5)


def test_default_falls_back_to_a_modulelist_of_repeated_layers() -> None:
    """Without `Block` classes the children of the repeated ModuleList are chosen."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList(nn.Linear(4, 4) for _ in range(3)))
    assert enable_activation_checkpointing(model) == ["1.0", "1.1", "1.2"]


def test_generation_through_checkpointed_blocks_is_unchanged(tiny_model: GPT) -> None:
    """Under no_grad the wrapped blocks run plainly, so a KV cache is updated once per layer."""
    prompt = torch.tensor([[1, 2, 3, 4]])
    expected = generate(tiny_model, prompt, 8, allocator="paged")
    enable_activation_checkpointing(tiny_model)
    assert torch.equal(generate(tiny_model, prompt, 8, allocator="paged"), expected)


def test_wrapped_model_survives_deepcopy_and_torch_save(
    tiny_model: GPT, batch: torch.Tensor
) -> None:
    """Copies of a wrapped model stay wrapped, around their own modules, with equal loss."""
    enable_activation_checkpointing(tiny_model)
    buf = io.BytesIO()
    torch.save(tiny_model, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(tiny_model), torch.load(buf, weights_only=False)):
        assert checkpointed_modules(clone) == ["blocks.0", "blocks.1"]
        assert clone.blocks[0].forward.module is clone.blocks[0]
        assert lm_loss(clone, batch).item() == lm_loss(tiny_model, batch).item()


def test_meter_counts_each_storage_once_and_tracks_release() -> None:
    """A tensor saved twice counts once; live bytes return to zero once the graph is freed."""
    x = torch.randn(1000, requires_grad=True)
    y = x * 2
    with SavedActivationMeter() as meter:
        z = (y * y).sum()  # saves y twice (both operands)
    assert meter.bytes == meter.live == meter.peak == 4000
    assert meter.tensors == 2
    z.backward()
    del z
    assert meter.live == 0
    assert meter.peak == 4000


def test_meter_skips_parameters_unless_asked() -> None:
    """Parameters saved for backward are not activations unless count_parameters is set."""
    lin = nn.Linear(10, 10, bias=False)
    x = torch.randn(4, 10, requires_grad=True) * 2  # an activation: not a leaf
    with SavedActivationMeter(count_parameters=True) as full:
        lin(x).sum()
    with SavedActivationMeter() as plain:
        lin(x).sum()
    assert full.bytes == 4 * 10 * 4 + 10 * 10 * 4
    assert plain.bytes == 4 * 10 * 4


def test_cap_raises_oom_above_the_limit_only(tiny_model: GPT, batch: torch.Tensor) -> None:
    """The cap raises torch.OutOfMemoryError one byte under the need and passes at it."""
    need = saved_bytes(tiny_model, batch)
    oom = pytest.raises(torch.OutOfMemoryError, match="out of memory: tried to save")
    with oom, SavedActivationCap(need - 1):
        lm_loss(tiny_model, batch)
    with SavedActivationCap(need) as cap:
        lm_loss(tiny_model, batch).backward()
    assert cap.peak == need
    assert issubclass(torch.OutOfMemoryError, RuntimeError)


def test_cap_lets_a_checkpointed_model_fit(tiny_model: GPT, batch: torch.Tensor) -> None:
    """A cap that a plain forward exceeds is met once checkpointing is enabled (the OOM remedy)."""
    limit = saved_bytes(tiny_model, batch) // 2
    with pytest.raises(torch.OutOfMemoryError), SavedActivationCap(limit):
        lm_loss(tiny_model, batch)
    enable_activation_checkpointing(tiny_model)
    with SavedActivationCap(limit):
        lm_loss(tiny_model, batch).backward()
