"""OOM outcomes: a relieved OOM is one of the step's events; an unrelievable one ends the run, aborted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remedy.rank import Guard, GuardConfig
from remedy.rank.chaos.faults import parse_chaos
from remedy.rank.link.context import WorkerContext

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def test_step_result_lists_an_oom_relieved_on_retry() -> None:
    """A chaos OOM at step 3, relieved by the default policy: that step's StepResult.events has 'oom'."""
    model = _mlp()
    faults = parse_chaos({"faults": [{"kind": "oom", "at_step": 3, "rank": 0}]})
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        loss_fn=_loss,
        data=_batch,
        max_steps=6,
        config=GuardConfig(checkpoint_every=0),
        context=WorkerContext(faults=faults),
    )
    results = [guard.step(batch) for batch in guard]
    assert "oom" in results[3].events
    assert not results[3].optimizer_skipped, "relieved: the retry trained the step"
    assert all("oom" not in r.events for i, r in enumerate(results) if i != 3)


def test_an_oom_the_policy_cannot_relieve_aborts_the_run_within_a_few_steps(
    tmp_path: Path,
) -> None:
    """Every forward over its memory cap: the run ends aborted after oom_give_up_steps, with the reason."""
    model = _mlp()
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        loss_fn=_loss,
        data=_batch,
        max_steps=30,
        config=GuardConfig(checkpoint_every=0, activation_cap_bytes=1, oom_give_up_steps=3),
        run_dir=tmp_path,
    )
    for batch in guard:
        guard.step(batch)
    assert guard.step_count == 3
    assert guard.stopped is not None and "ran out of memory" in guard.stopped
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "aborted"
    assert "3 steps in a row ran out of memory" in summary["abort_reason"]
    assert summary["goodput"] == 0.0, "no update was applied"
    assert summary["final_loss"] is None
