"""The outbox: news goes out at once, quiet steps at most every heartbeat; metrics built on sending."""

from __future__ import annotations

from typing import Any

from remedy.protocol.commands import Command
from remedy.rank.link.inbox import CommandInbox
from remedy.rank.link.outbox import Outbox


class _Collect:
    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []

    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        self.batches.append(batch)

    def poll(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        pass


class _Target:
    """The least an applier of shrink_lr needs: an LR scale."""

    rank, step_count, tick = 0, 3, 3
    lr_scale = 1.0

    def refusal(self, action: str) -> str | None:
        return None

    def effective_lrs(self) -> list[float]:
        return [0.1 * self.lr_scale]

    def scale_lr(self, factor: float, *, min_lr: float = 0.0) -> None:
        self.lr_scale *= factor


def test_heartbeat_news_and_outcomes_decide_when_a_report_leaves() -> None:
    """Quiet steps within the heartbeat stay; an event forced, or an outcome, goes at once."""
    sink, inbox = _Collect(), CommandInbox()
    out = Outbox(sink, inbox, rank=2, heartbeat_s=3600.0, build=lambda n: {"n": n})
    assert out.send(step=0, tick=0)  # the first report: nothing sent yet
    out.metrics(1)
    assert not out.send(step=1, tick=1), "within the heartbeat, no news"
    out.event({"kind": "loss_spike"})
    assert out.send(step=2, tick=2, force=True)
    assert sink.batches[-1]["metrics"] == [{"n": 1}]
    assert sink.batches[-1]["events"] == [{"kind": "loss_spike"}]
    cmd = Command("d1", "shrink_lr", {"factor": 0.5}, 3, 2, apply_at_tick=3)
    inbox.apply([cmd], _Target())  # type: ignore[arg-type]
    assert out.send(step=3, tick=3), "an outcome is news"
    assert [o["decision_id"] for o in sink.batches[-1]["outcomes"]] == ["d1"]
    assert sink.batches[-1]["rank"] == 2
    out.soon()
    assert out.send(step=3, tick=3), "soon(): the next report goes at once"
    assert "regrouped" not in sink.batches[-1]


def test_the_first_report_of_a_new_generation_goes_at_once_and_says_so() -> None:
    """After a regroup the next report leaves whatever the heartbeat, marked `regrouped` (a node
    agent sends its digest early on it); the one after is a plain report again."""
    sink, inbox = _Collect(), CommandInbox()
    out = Outbox(sink, inbox, rank=1, heartbeat_s=3600.0, build=lambda n: {"n": n})
    assert out.send(step=0, tick=0)
    out.regrouped()
    out.metrics(1)
    assert out.send(step=1, tick=1)
    assert sink.batches[-1]["regrouped"] is True
    assert out.send(step=2, tick=2, force=True)
    assert "regrouped" not in sink.batches[-1]


def test_a_guards_last_report_says_its_loop_ended() -> None:
    """The report a Guard sends when its loop ends carries `ending`: the supervisor's hang watch
    stops waiting for progress from a rank that takes no more steps (a rank in its final drain
    under load was once judged hung); no report before it does."""
    import torch  # noqa: PLC0415

    from remedy.rank import Guard, WorkerContext  # noqa: PLC0415

    sink = _Collect()
    model = torch.nn.Linear(2, 1)
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda m, b: m(b).pow(2).mean(),
        data=lambda i: torch.ones(4, 2),
        max_steps=3,
        context=WorkerContext(reporter=sink),  # type: ignore[arg-type]
    )
    for batch in guard:
        guard.step(batch)
    assert sink.batches[-1].get("ending") is True
    assert all("ending" not in b for b in sink.batches[:-1])
