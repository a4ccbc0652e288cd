"""After its last step a rank waits for what the supervisor still owes it (`rank.link.end_hold`).

A single rank's Guard reports to a `Decider`, the rank side of the supervisor
link, scripted as `SupervisorActor.report` answers a report `holding` its last
tick with `final`: not settled while a decision is owed, then the command, then
settled once the command's outcome is in. The supervisor's side is
`control.end_check.may_end` (tests/supervisor/core/test_end_check.py); the
supervised path is tests/supervisor/test_spike_after_restart_e2e.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from remedy.protocol.commands import Command
from remedy.rank import Guard, GuardConfig
from remedy.rank.link.context import WorkerContext

pytestmark = [pytest.mark.timeout(120)]

STEPS = 12


class Decider:
    """Answers final holds: owes `command` for `owe_rounds` reports, then sends it, then says
    settled once its outcome came (or never, with `settles=False`)."""

    def __init__(self, command: Command | None, *, owe_rounds: int = 3, settles: bool = True):
        self.command = command
        self.owe_rounds = owe_rounds
        self.settles = settles
        self.finals: list[tuple[int, int]] = []  # (step, holding tick) of each final report
        self.outcomes: list[dict[str, Any]] = []
        self._settled = -1
        self._replies: list[dict[str, Any]] = []

    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        self.outcomes.extend(batch.get("outcomes", []))
        tick = batch.get("holding")
        if tick is None or not batch.get("final"):
            return
        self.finals.append((batch["step"], tick))
        if self.command is not None and len(self.finals) == self.owe_rounds:
            self._replies.append(self.command.to_dict())  # the decision owed, now taken
        owed = self.command is not None and not self.outcomes
        if self.settles and not owed:
            self._settled = max(self._settled, tick)

    def poll(self) -> list[dict[str, Any]]:
        out, self._replies = self._replies, []
        return out

    def settled(self) -> int:
        return self._settled

    def close(self) -> None:
        pass


def _train(decider: Decider, end_wait_s: float = 30.0) -> Guard:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ctx = WorkerContext(rank=0, world_size=1, reporter=decider)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        return x, x.sum(dim=1, keepdim=True)

    guard = Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.01),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), data=batch,
        max_steps=STEPS, context=ctx,
        config=GuardConfig(snapshot_every=5, checkpoint_every=0, end_wait_s=end_wait_s),
    )  # fmt: skip
    for b in guard:
        guard.step(b)
    guard.close()
    return guard


def test_nothing_owed_ends_after_one_round() -> None:
    """The supervisor owes nothing: one final report, settled, the loop ends at its last step."""
    decider = Decider(None)
    guard = _train(decider)
    assert decider.finals == [(STEPS, STEPS - 1)]
    assert (guard.step_count, guard.tick) == (STEPS, STEPS)


def test_a_rollback_decided_after_the_last_step_is_applied_and_trained_again() -> None:
    """A rollback comes while the rank holds at its last step: it is applied there, the steps
    after the restored one are trained again, and the rank holds at its end once more."""
    rollback = Command("d1", "rollback", {"steps_back": 5}, STEPS, STEPS - 2, STEPS, seq=1)
    decider = Decider(rollback)
    guard = _train(decider)
    [outcome] = [o for o in decider.outcomes if o["decision_id"] == "d1"]
    assert outcome["outcome"] == "applied" and outcome["step"] == STEPS, outcome
    assert "restored step 5" in outcome["detail"], outcome
    # Held at tick 11 until the rollback came, trained steps 5..11 again, then one more hold.
    first = [t for _, t in decider.finals if t == STEPS - 1]
    assert len(first) == 3 and decider.finals[-1] == (STEPS, STEPS + 6), decider.finals
    assert (guard.step_count, guard.tick) == (STEPS, STEPS + 7)


def test_a_supervisor_that_never_settles_lets_the_rank_end_after_the_wait() -> None:
    """Never settled: the rank ends after `end_wait_s`, having held and reported meanwhile."""
    decider = Decider(None, settles=False)
    guard = _train(decider, end_wait_s=0.3)
    assert len(decider.finals) >= 2 and {t for _, t in decider.finals} == {STEPS - 1}
    assert guard.step_count == STEPS
