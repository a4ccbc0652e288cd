"""The default policy relieves a real OOM on models without transformer blocks; a dry run does not wait."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remedy.rank import Guard, GuardConfig
from remedy.rank.actions.activation_checkpointing import (
    SavedActivationMeter,
    checkpointed_modules,
    enable_activation_checkpointing,
)
from remedy.rank.loop.target import load_target
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


REPO = Path(__file__).resolve().parents[2]
# The conv net of the clean-run corpus: two conv stages in `features`, a linear head.
ConvNet = load_target(f"{REPO / 'examples' / 'loops' / 'convnet.py'}:ConvNet")


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 5)
    )


def batches(model: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shape = (32, 20) if model == "mlp" else (32, 1, 16, 16)
    classes = 5 if model == "mlp" else 4
    return [
        (torch.randn(*shape, generator=gen), torch.randint(0, classes, (32,), generator=gen))
        for _ in range(8)
    ]


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return mlp() if name == "mlp" else ConvNet()


def saved_bytes(model: nn.Module, batch: Any) -> int:
    with SavedActivationMeter() as meter:
        loss_fn(model, batch)
    return meter.peak


@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_default_policy_relieves_a_real_oom_on_any_model(name: str, tmp_path: Path) -> None:
    """Saved activations over the cap raise a real OOM at the first step; the default policy's
    oom-relief finds something to checkpoint in a model with no transformer blocks, halves the
    micro-batch, and the step is retried: every step completes, nothing fails."""
    data = batches(name)
    cap = int(saved_bytes(build(name), data[0]) * 0.6)
    model = build(name)
    guard = Guard(
        model, torch.optim.Adam(model.parameters(), lr=1e-3), loss_fn=loss_fn, data=data,
        config=GuardConfig(policy="default", activation_cap_bytes=cap), run_dir=tmp_path,
    )  # fmt: skip
    results = [guard.step(batch) for batch in guard]
    summary = guard.summary
    assert summary["status"] == "completed"
    assert summary["steps_completed"] == summary["steps_executed"] == 8
    assert all(not r.optimizer_skipped for r in results)
    assert checkpointed_modules(model) and guard.micro_batches == 2
    assert [a["kind"] for a in read_jsonl(tmp_path / "anomalies.jsonl")] == ["oom"]
    decisions = read_jsonl(tmp_path / "decisions.jsonl")
    assert [(d["action"], d["outcome"]) for d in decisions] == [
        ("enable_activation_checkpointing", "applied"),
        ("reduce_microbatch", "applied"),
    ]


def test_checkpointing_targets_stages_or_the_whole_model() -> None:
    """Without Blocks or a ModuleList: a conv net's `features` stage; a model of leaf layers is
    wrapped whole; either way the saved activations shrink and the loss is unchanged."""
    data = batches("convnet")[0]
    model = build("convnet")
    before, loss = saved_bytes(model, data), float(loss_fn(model, data).detach())
    assert enable_activation_checkpointing(model, fraction=0.5) == ["features"]
    assert saved_bytes(model, data) < 0.6 * before
    assert float(loss_fn(model, data).detach()) == loss
    model = build("mlp")
    data = batches("mlp")[0]
    before = saved_bytes(model, data)
    assert enable_activation_checkpointing(model) == [""]
    assert saved_bytes(model, data) < 0.6 * before


DRY_POLICY = """
version: 1
name: dry
dry_run: true
rules:
  - name: oom-relief
    when: {anomaly: oom}
    do: [reduce_microbatch: {factor: 2}]
"""


@pytest.mark.timeout(60)
def test_dry_run_oom_does_not_wait_for_commands(tmp_path: Path) -> None:
    """In a dry run no command answers an OOM: the step gives up as soon as the policy's reply is
    in, not after oom_wait_s (an hour here, far past this test's timeout), and training goes on."""
    policy = tmp_path / "dry.yaml"
    policy.write_text(DRY_POLICY)
    data = batches("mlp")
    cap = int(saved_bytes(build("mlp"), data[0]) * 0.6)
    model = build("mlp")
    guard = Guard(
        model, torch.optim.Adam(model.parameters(), lr=1e-3), loss_fn=loss_fn, data=data,
        config=GuardConfig(
            policy=str(policy), activation_cap_bytes=cap, oom_wait_s=3600.0, oom_give_up_steps=0
        ),
        run_dir=tmp_path / "run",
    )  # fmt: skip
    results = [guard.step(batch) for batch in guard]
    assert len(results) == 8 and all(r.optimizer_skipped for r in results)
    outcomes = [d["outcome"] for d in read_jsonl(tmp_path / "run" / "decisions.jsonl")]
    assert outcomes and set(outcomes) <= {"dry_run"}
