"""The callbacks' LoopGuard shares the Guard's command inbox: failed chains, resent outcomes,
the seq agreement of a process group's ranks.

Every action under the callbacks: tests/integrations/test_action_table.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from remedy.integrations._loop import LoopGuard
from remedy.protocol.commands import Command
from remedy.rank.link import inbox as inbox_mod
from remedy.rank.link.context import WorkerContext

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(60)]


class _Supervisor:
    """Sends the same commands on every reply, as a supervisor that never got the outcomes."""

    def __init__(self, commands: list[dict[str, Any]]) -> None:
        self.commands = commands
        self.batches: list[dict[str, Any]] = []

    def send(self, batch: dict[str, Any], *, wait: bool = False) -> None:
        self.batches.append(batch)

    def poll(self) -> list[dict[str, Any]]:
        return [dict(c) for c in self.commands]

    def close(self) -> None:
        pass


def _train(guard: LoopGuard, steps: int) -> None:
    """A loop someone else drives: the hooks a framework callback calls, in its order."""
    model = guard.model
    opt = guard.optimizer
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        guard.begin_step()
        x = torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        guard.record_loss(loss)
        loss.backward()
        guard.before_optimizer_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        guard.end_step()


def _loop_guard(tmp_path: Path | None = None, context: WorkerContext | None = None) -> LoopGuard:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    guard = LoopGuard(model, run_dir=tmp_path, detectors=[], context=context)
    guard.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    return guard


def _cmd(decision_id: str, action: str, params: dict[str, Any], **kw: Any) -> Command:
    return Command(decision_id, action, params, 1, 0, apply_at_tick=1, seq=1, **kw)


def test_a_failed_step_fails_the_rest_of_its_chain_under_a_callback() -> None:
    """A refused first step of a chain: the second is not run, as in the Guard."""
    guard = _loop_guard()
    guard.submit(_cmd("d1", "reduce_microbatch", {"factor": 2}, chain_id="c", chain_index=0))
    guard.submit(_cmd("d2", "shrink_lr", {"factor": 0.5}, chain_id="c", chain_index=1))
    _train(guard, 3)
    guard.close()
    assert [o.outcome for o in guard.history] == ["failed", "failed"]
    assert guard.history[1].detail == "not run: an earlier step of its chain failed"
    assert guard.lr_scale == 1.0


@pytest.mark.parametrize("resend_s", [0.0, 3600.0])
def test_done_command_sent_again_gets_its_outcome_again_under_a_callback(
    monkeypatch: pytest.MonkeyPatch, resend_s: float
) -> None:
    """shrink_lr on every reply: the LR is cut once; the outcome goes out again only past OUTCOME_RESEND_S."""
    monkeypatch.setattr(inbox_mod, "OUTCOME_RESEND_S", resend_s)
    sup = _Supervisor([_cmd("d1", "shrink_lr", {"factor": 0.5}).to_dict()])
    guard = _loop_guard(context=WorkerContext(reporter=sup))
    _train(guard, 6)
    guard.close()
    assert guard.lr_scale == 0.5
    sent = [o for b in sup.batches for o in b["outcomes"] if o["decision_id"] == "d1"]
    assert {o["outcome"] for o in sent} == {"applied"}
    assert (len(sent) > 1) if resend_s == 0.0 else (len(sent) == 1)


def test_a_local_policy_names_the_steps_the_callbacks_refuse_before_training(
    tmp_path: Path,
) -> None:
    """A bundled policy under a callback runs its callback version: no warning. A policy file
    of the user's with steps the callbacks refuse: those steps are logged at the start (what
    `remedy policy check --loop callbacks FILE` reports)."""
    model = nn.Linear(4, 1)
    for name in ("default", "conservative", "llm-pretrain"):
        with structlog.testing.capture_logs() as logs:
            LoopGuard(model, policy=name, run_dir=tmp_path / name, detectors=[]).close()
        assert [r for r in logs if r["event"] == "policy_steps_refused_under_callbacks"] == []
    own = tmp_path / "mine.yaml"
    own.write_text(
        "version: 1\nrules:\n  - name: hw\n    when: {anomaly: gpu_ecc}\n"
        "    do:\n      - checkpoint_now:\n        on_failure: next\n      - notify\n"
    )
    with structlog.testing.capture_logs() as logs:
        LoopGuard(model, policy=str(own), run_dir=tmp_path / "own", detectors=[]).close()
    (record,) = [r for r in logs if r["event"] == "policy_steps_refused_under_callbacks"]
    assert record["log_level"] == "warning"
    step = (
        "rule 'hw', step 1: checkpoint_now is not applied under the Hugging Face "
        "and Lightning callbacks: the framework writes its own checkpoints: remedy keeps no "
        "durable checkpoint under a callback"
    )
    assert record["steps"] == [step]


class _LateSupervisor(_Supervisor):
    """Sends the commands from its `first`-th reply on: replies reach ranks at different times."""

    def __init__(self, commands: list[dict[str, Any]], first: int) -> None:
        super().__init__(commands)
        self.first, self.polls = first, 0

    def poll(self) -> list[dict[str, Any]]:
        self.polls += 1
        return super().poll() if self.polls >= self.first else []


# Rank 0 gets the command at its first boundary, rank 1 at its fourth (step 3).
FIRST_REPLY_WITH_IT = (1, 4)


def _rank_main(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        sup = _LateSupervisor(
            [_cmd("d1", "shrink_lr", {"factor": 0.5}).to_dict()], FIRST_REPLY_WITH_IT[rank]
        )
        guard = _loop_guard(context=WorkerContext(rank=rank, world_size=2, reporter=sup))
        _train(guard, 6)
        guard.close()
        (outcome,) = guard.history
        record = {"step": outcome.step, "outcome": outcome.outcome, "lr_scale": guard.lr_scale}
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def test_ranks_under_a_callback_apply_a_command_at_the_same_boundary(tmp_path: Path) -> None:
    """Two ranks of a gloo group, the command reaching them three steps apart: both apply it at
    the boundary where the later one has it (the inbox's seq agreement), not each on arrival."""
    mp.start_processes(_rank_main, args=(str(tmp_path),), nprocs=2, start_method="fork")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks == [{"step": 3, "outcome": "applied", "lr_scale": 0.5}] * 2


def test_a_rank_under_a_callback_says_it_never_re_forms_its_group() -> None:
    """The membership of a rank whose loop a framework drives answers `regroups: False` from
    the LoopGuard's creation on, so the supervisor replaces it at once when a peer is lost
    instead of waiting for it to regroup (`supervisor.recovery.Recovery._blocked`); before,
    nothing is claimed."""
    from remedy.rank.group.membership import Membership  # noqa: PLC0415

    membership = Membership(rank=0, world_size=2, store_addr=("127.0.0.1", 1), backend="gloo")
    assert membership.status()["regroups"] is None
    sup = _Supervisor([])
    _loop_guard(context=WorkerContext(rank=0, world_size=2, reporter=sup, membership=membership))
    assert membership.status()["regroups"] is False


def test_updates_skipped_on_a_commands_order_are_not_a_run_that_stopped_learning() -> None:
    """A callback drops the updates of 25 batches a `skip_batches` asked for: that is a remedy at
    work; the run's tail is not unhealthy. The same 25 drops of non-finite steps would be."""
    guard = _loop_guard()
    guard.cursor.skip_next(25)
    _train(guard, 25)
    summary = guard.close()
    assert summary["updates_skipped"] == 25
    assert summary["learning"]["unhealthy_tail"] is None, summary["learning"]
