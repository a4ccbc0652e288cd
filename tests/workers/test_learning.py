"""A run that stops learning: a nanoGPT-shaped fp16 loop under a real GradScaler meets a 40-step
overflow storm and learns again after it; a storm no rescue relieves ends the run `aborted` or
`degraded` with the reason, never `completed`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remedy.rank import Guard, GuardConfig, WorkerContext
from remedy.rank.chaos.faults import parse_chaos
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(240)]

VOCAB, BLOCK, BATCH = 64, 32, 8


class TinyGPT(nn.Module):
    """nanoGPT's shape at toy size: token and position embeddings, one MLP block, a vocab head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.pos = nn.Embedding(BLOCK, 32)
        self.mlp = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(x + self.mlp(x))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A next-token batch of a repeating pattern (learnable, so the loss falls)."""
    gen = torch.Generator().manual_seed(i)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    seq = (start + torch.arange(BLOCK + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def loss_fn(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = model(b[0])
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), b[1].reshape(-1))


def storm_run(tmp_path: Path, *, at: int, duration: int, steps: int) -> dict[str, Any]:
    """Train TinyGPT in float16 autocast under a Guard alone (the default policy) through a
    `scaler_overflow_storm`; the run's summary.json."""
    torch.manual_seed(0)
    model = TinyGPT()
    faults = parse_chaos(
        {"faults": [{"kind": "scaler_overflow_storm", "at_step": at, "duration": duration}]}
    )
    guard = Guard(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), loss_fn=loss_fn, data=batch,
        max_steps=steps, scaler=torch.amp.GradScaler("cpu"),
        context=WorkerContext(run_dir=tmp_path / "run", faults=list(faults)),
        config=GuardConfig(amp_dtype=torch.float16),
    )  # fmt: skip
    for b in guard:
        guard.step(b)
    guard.close()
    return dict(json.loads((tmp_path / "run" / "summary.json").read_text()))


def metrics(tmp_path: Path) -> list[dict[str, Any]]:
    return read_jsonl(tmp_path / "run" / "metrics.jsonl")


def test_a_storm_that_outlasts_the_rescue_is_rescued_again(tmp_path: Path) -> None:
    """A 40-step storm at step 60 collapses the scale more than once: each collapse is rescued,
    the scale is back within 20 steps of the storm's end and the last 30 steps learn."""
    summary = storm_run(tmp_path, at=60, duration=40, steps=150)
    m = metrics(tmp_path)
    end = 100  # the storm's last executed step is 99
    back = [r["step"] for r in m if r["step"] >= end and r["loss_scale"] >= 1.0]
    assert back and back[0] <= end + 20, [r["loss_scale"] for r in m[end : end + 25]]
    tail = m[-30:]
    assert all(isinstance(r["grad_norm"], float) and r["grad_norm"] > 0 for r in tail), tail
    assert not any(r["optimizer_skipped"] for r in tail)
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    rescues = [
        d for d in decisions if d["rule"] == "scaler-collapse-reset" and d["outcome"] == "applied"
    ]
    assert len(rescues) >= 2, "the scale collapsed again and was rescued again"
    assert summary["status"] == "completed", summary.get("degraded_reason")
    learning = summary["ranks"][0]["learning"]
    assert learning["unhealthy_tail"] is None and learning["updates_skipped"] >= 40


def test_an_unrelieved_storm_is_aborted_with_the_reason(tmp_path: Path) -> None:
    """A storm that never ends: rescues, then rollbacks, then the policy stops the run, and
    says it stopped learning; never `completed`."""
    summary = storm_run(tmp_path, at=40, duration=400, steps=250)
    assert summary["status"] == "aborted", summary
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    rules = [d["rule"] for d in decisions if d["outcome"] == "applied"]
    assert "learning-rescue" in rules and "learning-rollback" in rules, rules
    assert "learning-rollback" in summary["abort_reason"], summary["abort_reason"]


def test_a_storm_at_the_end_leaves_the_run_degraded(tmp_path: Path) -> None:
    """A storm that outlasts the run: it reaches its last step without learning for 25 steps,
    and summary.json says `degraded` with the reason."""
    summary = storm_run(tmp_path, at=75, duration=100, steps=100)
    assert summary["status"] == "degraded", summary
    assert "no learning in the last 20 steps" in summary["degraded_reason"]
    assert "every update was skipped" in summary["degraded_reason"]


def test_underflowing_gradients_are_identically_zero_and_counted(tmp_path: Path) -> None:
    """With the loss scale pinned far below its floor, float16 gradients underflow to exactly
    0.0: the learning counts see it (the cause of the quiet death the rescue prevents)."""
    torch.manual_seed(0)
    model = TinyGPT()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-24, growth_interval=10_000)
    guard = Guard(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), loss_fn=loss_fn, data=batch,
        max_steps=30, scaler=scaler, context=WorkerContext(run_dir=tmp_path / "run"),
        config=GuardConfig(amp_dtype=torch.float16, policy="conservative"),
    )  # fmt: skip
    for b in guard:
        guard.step(b)
    rank = guard.close()
    assert rank["learning"]["zero_grad_steps"] == 30, rank["learning"]
    assert "gradients were identically zero" in rank["learning"]["unhealthy_tail"]
    stopped = [
        a
        for a in read_jsonl(tmp_path / "run" / "anomalies.jsonl")
        if a["kind"] == "learning_stopped"
    ]
    assert stopped and stopped[0]["details"]["cause"] == "zero_grad", stopped
