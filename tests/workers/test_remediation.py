"""The remediation state as its own part: what it gives, what adopting it puts in force, and
that the Guard's appliers, its replacement's adoption and its resume all go through it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from remedy.protocol.commands import Command
from remedy.rank.actions.activation_checkpointing import (
    checkpointed_modules,
    enable_activation_checkpointing,
)
from remedy.rank.actions.remediation import KEYS, Remediation, plain
from remedy.rank.guard import Guard, GuardConfig
from remedy.rank.state import train_state

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Wrapper(nn.Module):
    """Holds its model as `module`, as DistributedDataParallel does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_remediation_given_as_state_is_put_in_force_on_another_model() -> None:
    """Cuts, split, allocator and the checkpointed blocks (by name, through a wrapper)."""
    torch.manual_seed(0)
    source = Wrapper(Blocks())
    enable_activation_checkpointing(plain(source), modules=["blocks.1", "blocks.3"])
    mine = Remediation(micro_batches=4, kv_allocator="paged")
    mine.lr_cut.cut(0.5, min_lr=1e-5)
    mine.lr_cut.cut(0.5)
    state = json.loads(json.dumps(mine.state(source)))  # plain values: a checkpoint's extra
    assert set(state) == set(KEYS)
    assert state["checkpointed"] == ["blocks.1", "blocks.3"]
    target = copy.deepcopy(Blocks())
    theirs = Remediation()
    theirs.adopt(state, target)
    assert (theirs.micro_batches, theirs.kv_allocator) == (4, "paged")
    assert (theirs.lr_scale, theirs.lr_cut.floor) == (0.25, 1e-5)
    assert checkpointed_modules(target) == ["blocks.1", "blocks.3"]
    # Adopted again (a second restart from the same state): nothing is wrapped twice.
    theirs.adopt(state, target)
    assert checkpointed_modules(target) == ["blocks.1", "blocks.3"]
    assert target(torch.ones(2, 8)).shape == (2, 1)


def test_nothing_in_force_gives_the_defaults_and_adopting_them_changes_nothing() -> None:
    model = Blocks()
    fresh = Remediation()
    assert fresh.state(model) == {
        "micro_batches": 1, "kv_allocator": "fixed", "lr_cut": (1.0, 0.0), "checkpointed": [],
    }  # fmt: skip
    other = Remediation(micro_batches=2)
    other.adopt(fresh.state(model), model)
    assert other.micro_batches == 1 and checkpointed_modules(model) == []


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _guard(model: nn.Module) -> Guard:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(8)]
    return Guard(model, opt, loss_fn=_loss, data=data, max_steps=4, config=GuardConfig())


def _command(action: str, params: dict[str, object], seq: int) -> Command:
    return Command(f"r-d{seq:05d}", action, dict(params), apply_at_step=0, anomaly_step=0, seq=seq)


def test_the_guards_appliers_change_its_remediation_and_a_replacement_adopts_it() -> None:
    """reduce_microbatch, shrink_lr, enable_activation_checkpointing and switch_kv_allocator on a
    Guard land in its `Remediation`; a second Guard adopting the first's state has all four."""
    torch.manual_seed(0)
    first = _guard(Blocks())
    for seq, (action, params) in enumerate(
        [("reduce_microbatch", {"factor": 2}), ("shrink_lr", {"factor": 0.5}),
         ("enable_activation_checkpointing", {"pattern": "blocks.0"}),
         ("switch_kv_allocator", {"to": "paged"})],
        start=1,
    ):  # fmt: skip
        first.submit(_command(action, params, seq))
    for batch in first:
        first.step(batch)
    assert [o.outcome for o in first.history] == ["applied"] * 4, first.history
    r = first.remediation
    assert (r.micro_batches, r.lr_scale, r.kv_allocator) == (2, 0.5, "paged")
    assert (first.micro_batches, first.kv_allocator, first.lr_scale) == (2, "paged", 0.5)
    assert r.max_micro_batches == 4  # the batch size bounds the next split
    state = train_state.capture(first)
    torch.manual_seed(1)
    second = _guard(Blocks())
    train_state.adopt(second, state)
    assert second.remediation.state(second.model) == r.state(first.model)
    assert checkpointed_modules(second.model) == ["blocks.0"]
