"""The Guard's inbox: a command applies once; sent again after it was done, it gets its outcome again."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from remedy.protocol.commands import Command
from remedy.rank.guard import Guard, GuardConfig
from remedy.rank.link import inbox as inbox_mod
from remedy.rank.link.context import WorkerContext


class _Supervisor:
    """Keeps sending the same command on every reply, as a supervisor that never got the outcome."""

    def __init__(self, command: dict[str, Any]) -> None:
        self.command = command
        self.batches: list[dict[str, Any]] = []

    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        self.batches.append(batch)

    def poll(self) -> list[dict[str, Any]]:
        return [dict(self.command)]

    def close(self) -> None:
        pass


def _guard(sup: _Supervisor) -> Guard:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b), torch.zeros(len(b), 1)),
        data=lambda i: torch.randn(8, 4, generator=torch.Generator().manual_seed(i)),
        max_steps=6,
        config=GuardConfig(checkpoint_every=0, heartbeat_s=0.0, detectors=[]),
        context=WorkerContext(reporter=sup),
    )


def _lr_cut(decision_id: str) -> dict[str, Any]:
    return Command(
        decision_id, "shrink_lr", {"factor": 0.5}, 1, 0, apply_at_tick=1, seq=1
    ).to_dict()


@pytest.mark.parametrize("resend_s", [0.0, 3600.0])
def test_done_command_sent_again_is_not_applied_again_but_its_outcome_is_resent(
    monkeypatch: pytest.MonkeyPatch, resend_s: float
) -> None:
    """shrink_lr sent on every reply: the LR is cut once; its outcome goes out again only past OUTCOME_RESEND_S."""
    monkeypatch.setattr(inbox_mod, "OUTCOME_RESEND_S", resend_s)
    sup = _Supervisor(_lr_cut("r-d00001"))
    guard = _guard(sup)
    for batch in guard:
        guard.step(batch)
    assert guard.lr_scale == 0.5  # applied once, not at every boundary
    sent = [o for b in sup.batches for o in b["outcomes"] if o["decision_id"] == "r-d00001"]
    assert {o["outcome"] for o in sent} == {"applied"}
    if resend_s == 0.0:
        assert len(sent) > 1  # the supervisor still asks: the outcome goes out again
    else:
        assert len(sent) == 1
