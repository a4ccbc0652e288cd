"""The Guard's inbox: a command applies once; sent again after it was done, it gets its outcome
again; sent again under the same id for another action, it is refused (failed, saying why)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from remedy.protocol.commands import Command
from remedy.rank.guard import Guard, GuardConfig
from remedy.rank.link import inbox as inbox_mod
from remedy.rank.link.context import WorkerContext
from remedy.rank.link.inbox import CommandInbox


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


def _guard(sup: Any, max_steps: int = 6) -> Guard:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b), torch.zeros(len(b), 1)),
        data=lambda i: torch.randn(8, 4, generator=torch.Generator().manual_seed(i)),
        max_steps=max_steps,
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


class _ReusingSupervisor:
    """Sends `first` on the first replies, then `then` under the same id (a supervisor that lost
    its journal and gave the id out again)."""

    def __init__(self, first: dict[str, Any], then: dict[str, Any], switch_after: int) -> None:
        self.commands = [first, then]
        self.switch_after = switch_after
        self.polls = 0
        self.batches: list[dict[str, Any]] = []

    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        self.batches.append(batch)

    def poll(self) -> list[dict[str, Any]]:
        self.polls += 1
        return [dict(self.commands[self.polls > self.switch_after])]

    def close(self) -> None:
        pass


def _command(decision_id: str, action: str, params: dict[str, Any], seq: int) -> dict[str, Any]:
    return Command(decision_id, action, params, 1, 0, apply_at_tick=1, seq=seq).to_dict()


def test_a_reused_id_for_another_action_is_refused_and_the_old_action_not_repeated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """d00001 applied as shrink_lr, then sent as another shrink: refused (failed, naming both actions), LR cut once."""
    monkeypatch.setattr(inbox_mod, "OUTCOME_RESEND_S", 0.0)
    first = _command("r-d00001", "shrink_lr", {"factor": 0.5}, 1)
    then = _command("r-d00001", "switch_kv_allocator", {"to": "paged"}, 1)
    sup = _ReusingSupervisor(first, then, switch_after=3)
    guard = _guard(sup, max_steps=8)
    for batch in guard:
        guard.step(batch)
    assert guard.lr_scale == 0.5
    sent = [o for b in sup.batches for o in b["outcomes"] if o["decision_id"] == "r-d00001"]
    refusals = [o for o in sent if o["outcome"] == "failed"]
    assert refusals, sent
    assert "applied already, for shrink_lr, not switch_kv_allocator" in refusals[0]["detail"]
    # Once refused, the refusal (not the old applied outcome) is what goes out again.
    after = sent[sent.index(refusals[0]) :]
    assert {o["outcome"] for o in after} == {"failed"}


def test_the_same_id_for_the_same_action_is_still_a_duplicate() -> None:
    """A command sent again as it was is not queued again (no refusal): the old rule stands."""
    inbox = CommandInbox()
    cmd = Command("r-d00002", "shrink_lr", {"factor": 0.5}, 1, 0, seq=2)
    inbox.done_ids.add(cmd.decision_id)
    inbox.actions[cmd.decision_id] = "shrink_lr"
    inbox.take([cmd.to_dict()])
    assert inbox.queued == {}
    other = Command("r-d00002", "rollback", {}, 1, 0, seq=2)
    inbox.take([other.to_dict()])
    assert list(inbox.queued) == ["r-d00002"]


def test_the_applied_actions_travel_with_the_inbox_record() -> None:
    """state/adopt carry each done id's action: a replacement rank refuses a reused id too."""
    inbox = CommandInbox()
    inbox.done_ids.update({"r-d00001", "r-s2-d00003", "r-s2-d00010"})
    inbox.actions.update({"r-d00001": "rollback", "r-s2-d00003": "shrink_lr"})
    other = CommandInbox()
    other.adopt(inbox.state())
    assert other.actions == inbox.actions
    assert other.latest_applied() == ["r-d00001", "r-s2-d00010"]
