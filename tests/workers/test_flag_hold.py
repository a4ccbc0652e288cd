"""A flagged step waits at the next boundary for the supervisor's decision (workers.flag_hold).

Two gloo ranks train a small GPT under DDP, each Guard reporting to a
`Decider`: the rank side of the supervisor link, scripted. It answers a
report `holding` a tick with "settled" only after `delay_s` (the supervisor
waiting on the other rank's report, deciding), and with the decided command,
if any, in the same reply, as `SupervisorActor.report` does. The supervised
path is tests/supervisor/test_replay_e2e.py; the supervisor's side of the
protocol is `Controller.settled` (tests/supervisor/core/test_control_replay.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.protocol.commands import Command
from remedy.rank import Guard, GuardConfig
from remedy.rank.chaos.faults import parse_chaos
from remedy.rank.link.context import WorkerContext
from remedy.rank.link.flag_hold import QUIET_STEPS, FlagHold
from tests.workers.fsdp_ranks import spawn_ranks

pytestmark = [pytest.mark.timeout(300)]

CFG = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
S = 6  # the step the fault hits
STEPS = 12
DELAY_S = 0.4


class Decider:
    """Replies as a supervisor would: `settled` for a held tick after `delay_s`, with `answer`."""

    def __init__(self, *, delay_s: float, answer: list[dict[str, Any]], settles: bool = True):
        self.delay_s = delay_s
        self.answer = answer  # the commands decided on the flagged step
        self.settles = settles
        self.holding: list[int] = []  # the tick of every report sent while holding
        self._first: float | None = None
        self._settled = -1
        self._replies: list[dict[str, Any]] = []

    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        tick = batch.get("holding")
        if tick is None:
            return
        if batch.get("final"):  # the last boundary (rank.link.end_hold): nothing is owed there
            self._settled = max(self._settled, tick)
            return
        self.holding.append(tick)
        self._first = self._first or time.monotonic()
        if self.settles and time.monotonic() - self._first >= self.delay_s and self._settled < tick:
            self._settled = tick
            self._replies.extend(self.answer)

    def poll(self) -> list[dict[str, Any]]:
        out, self._replies = self._replies, []
        return out

    def settled(self) -> int:
        return self._settled

    def close(self) -> None:
        pass


def _train(rank: int, world: int, case: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(GPT(CFG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = SyntheticCorpus(block_size=16, batch_size=4, seed=0)
    replay = Command("d1", "replay_step", {"tolerance": 0.0}, S + 1, S, S + 1, seq=1)
    fault = {"kind": "bad_rank" if case == "quiet" else "bitflip", "target": "grad", "rank": 1}
    decider = Decider(
        delay_s=DELAY_S,
        answer=[replay.to_dict()] if case == "replay" else [],
        settles=case != "late",
    )
    ctx = WorkerContext(
        rank=rank,
        world_size=world,
        reporter=decider,
        faults=parse_chaos({"faults": [{**fault, "at_step": S}]}),
        hold_on_flag=True,
    )
    guard = Guard(
        model, optimizer, loss_fn=lm_loss, data=lambda i: corpus.batch(i * world + rank),
        max_steps=STEPS, context=ctx, config=GuardConfig(replay_wait_s=0.0, flag_wait_s=1.0),
    )  # fmt: skip
    ran: list[tuple[int, int, float]] = []  # (step, tick, when it started) of every step run
    for batch in guard:
        ran.append((guard.step_count, guard.tick, time.monotonic()))
        guard.step(batch)
    guard.close()
    outcomes = [o for o in guard.history if o.decision_id == "d1"]
    return {
        "ran": ran,
        "holding": decider.holding,
        "replay_tick": outcomes[0].tick if outcomes else None,
        "verdict": outcomes[0].result.get("verdict", {}).get("kind") if outcomes else None,
        "holds": guard.summary["flag_holds"],
    }


def _cases(rank: int, world: int) -> dict[str, Any]:
    return {case: _train(rank, world, case) for case in ("replay", "nothing", "late", "quiet")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_ranks(_cases, 2, tmp_path_factory.mktemp("flag_hold"))


def _gap_after(ran: list[tuple[int, int, float]], tick: int) -> float:
    """Seconds between the start of the step at `tick` and of the next one."""
    (i,) = [i for i, (_, t, _) in enumerate(ran) if t == tick]
    return ran[i + 1][2] - ran[i][2]


def test_the_replay_starts_at_the_boundary_after_the_flagged_step(
    runs: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        run = runs[rank]["replay"]
        # Nothing was trained past the flagged step: the replay ran at its very next boundary.
        assert run["replay_tick"] == S + 1, run
        assert run["verdict"] == "replay_transient", run
        # Both ranks held for the decision, reporting the flagged tick, for at least the delay.
        assert set(run["holding"]) == {S}, run["holding"]
        assert _gap_after(run["ran"], S) >= DELAY_S
        # The rank's summary says so: the flag of S held at the next boundary (whose step count
        # is still S: the flagged step's non-finite update was dropped).
        [hold] = [h for h in run["holds"] if h["tick"] == S]
        assert (hold["step"], hold["end"], hold["brought"]) == (S, "ready", True), run["holds"]
        assert hold["held_s"] >= DELAY_S
        # The replay went back to step S: it is run again, then training goes on to the end.
        steps = [step for step, _, _ in run["ran"]]
        assert steps == [*range(S + 1), *range(S, STEPS)], steps


def test_a_decision_of_nothing_lets_training_go_on(runs: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        run = runs[rank]["nothing"]
        assert run["replay_tick"] is None
        assert set(run["holding"]) == {S}
        assert [step for step, _, _ in run["ran"]] == list(range(STEPS))


def test_with_no_answer_the_ranks_go_on_together_after_the_bound(
    runs: list[dict[str, Any]],
) -> None:
    gaps = [_gap_after(runs[rank]["late"]["ran"], S) for rank in (0, 1)]
    assert all(gap >= 1.0 for gap in gaps), gaps
    assert all(runs[r]["late"]["holds"][0]["end"] == "late" for r in (0, 1))
    assert [[s for s, _, _ in runs[r]["late"]["ran"]] for r in (0, 1)] == [list(range(STEPS))] * 2


def test_a_fault_the_policy_lets_run_holds_once_then_stays_quiet(
    runs: list[dict[str, Any]],
) -> None:
    # bad_rank flags every step from S on; the first hold brought nothing, so the
    # next QUIET_STEPS steps (the rest of this run) do not hold.
    assert STEPS - S < QUIET_STEPS
    for rank in (0, 1):
        assert set(runs[rank]["quiet"]["holding"]) == {S}
        holds = runs[rank]["quiet"]["holds"]
        assert (holds[0]["end"], holds[0]["brought"]) == ("ready", False), holds
        assert {h["end"] for h in holds[1:]} == {"quiet"} and len(holds) > 1, holds


def test_the_quiet_period_and_the_switch() -> None:
    hold = FlagHold(on=True)
    assert not hold.due(None, 5)
    assert hold.due(5, 6)
    hold.after(6, brought=True)
    assert hold.due(6, 7)
    hold.after(7, brought=False)
    assert not hold.due(8, 9) and not hold.due(26, 7 + QUIET_STEPS - 1)
    assert hold.due(27, 7 + QUIET_STEPS)
    assert not FlagHold(on=False).due(5, 6)
    hold.flag(4)
    assert hold.take() == 4 and hold.take() is None


def test_a_rank_alone_holds_on_its_own_flag(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    corpus = SyntheticCorpus(block_size=16, batch_size=4, seed=0)
    decider = Decider(delay_s=DELAY_S, answer=[])
    ctx = WorkerContext(
        reporter=decider,
        faults=parse_chaos({"faults": [{"kind": "bitflip", "target": "grad", "at_step": S}]}),
        hold_on_flag=True,
    )
    guard = Guard(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), loss_fn=lm_loss,
        data=corpus.batch, max_steps=STEPS, context=ctx, config=GuardConfig(replay_window=8),
    )  # fmt: skip
    started: list[float] = []
    for batch in guard:
        started.append(time.monotonic())
        guard.step(batch)
    guard.close()
    assert set(decider.holding) == {S}
    assert started[S + 1] - started[S] >= DELAY_S
