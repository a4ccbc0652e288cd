"""The supervised benchmark's per-piece timing (`benchmarks/_pieces.py`) finds the Guard's pieces,
nests them as they are called, and leaves the training it times unchanged."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks._pieces import OUTERMOST, Pieces
from remedy import Guard, GuardConfig
from remedy.rank.link.context import WorkerContext


def _guard(steps: int) -> Guard:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(steps + 1)]
    return Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        data=data,
        max_steps=steps,
        config=GuardConfig(snapshot_every=1000),
        context=WorkerContext(),
    )


def test_pieces_time_the_guards_calls_nested_as_called() -> None:
    """Each step's boundary, forward/backward and report are timed once a step; the report
    (`send`) is found inside `finish_step`; the outermost pieces sum to no more than the loop."""
    guard = _guard(6)
    pieces = Pieces()
    pieces.wrap_guard(guard)
    pieces.on = True
    for batch in guard:
        guard.step(batch)
    guard.close()
    per_step = pieces.per_step(6)
    for name in ("boundary", "forward_backward", "finish_grads (norm)", "finish_step"):
        assert per_step[name] > 0, (name, per_step)
    assert per_step["finish_step / send"] > 0, "the report is sent inside finish_step"
    assert not any("agreement" in k for k in per_step), "alone in one process: no agreement"
    keys = list(per_step)
    assert keys.index("finish_step") < keys.index("finish_step / send"), "a caller first"
    assert per_step[OUTERMOST] >= per_step["boundary"] + per_step["forward_backward"]
    typical = pieces.typical(6)
    assert 0 < typical["forward_backward"] <= per_step["forward_backward"] * 6, typical
    assert len(guard.recent_stats) == 6, "the wrapped Guard trained every step"
