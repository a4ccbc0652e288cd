"""Every action of the table: policy check -> decide -> apply -> outcome, on a Guard and under the callbacks.

Two walks: one submits each decision's command by hand (to a Guard, and to the callbacks'
LoopGuard driven hook by hook) and reads the rank's own outcome; the other starts from a
detector's event and ends at the decision's line in decisions.jsonl, the command and its outcome
going through the controller and the shared inbox, on a Guard and under a `lightning.Trainer`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remedy.control.decide import Controller
from remedy.integrations._loop import REFUSED_UNDER_FRAMEWORKS, LoopGuard
from remedy.policies import AnomalyEvent, Engine, check_policy, load_policy
from remedy.policies._loops import Loop
from remedy.policies._params import ACTION_PARAMS
from remedy.policies._vocab import ACTION_TABLE, ACTIONS, SUPERVISOR_ACTIONS
from remedy.protocol.commands import Command
from remedy.rank import Guard, GuardConfig
from remedy.rank.actions.inprocess import APPLIERS
from remedy.rank.detectors.base import event
from remedy.rank.loop.stats import StepStats
from remedy.rundir.writer import read_jsonl

lightning = pytest.importorskip("lightning")
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from tests.integrations.lightning_builders import quiet_trainer  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]

# Parameters for actions whose defaults name nothing to act on.
EXAMPLE_PARAMS: dict[str, dict[str, Any]] = {
    "configure_cuda_allocator": {"expandable_segments": True},
    "enable_activation_checkpointing": {"modules": ["Linear"]},
    "rescale_grad_scaler": {"factor": 0.5},
    "skip_batches": {"count": 2},
    "switch_kv_allocator": {"to": "paged"},
}
# Failures that are this machine's, not the loop's: the applier says what is missing.
NEEDS_HERE = {
    "configure_cuda_allocator": "CUDA device",
    "rescale_grad_scaler": "needs an enabled GradScaler",
}
# replay_step re-runs a step a detector flagged; this loop runs no detector, and the
# failure says so (it is exercised on real anomalies in tests/workers/test_replay.py).
# A single rank keeps no step marks unless told to (GuardConfig.replay_window), so a replay
# it is asked for fails saying so.
NEEDS_AN_ANOMALY = {"replay_step": "replay_step needs the step boundaries the Guard remembers"}


def test_the_table_is_the_vocabulary_and_every_rank_action_has_an_applier() -> None:
    """ACTIONS, SUPERVISOR_ACTIONS and the parameter models come from one table; rank rows are applied."""
    assert tuple(a.name for a in ACTION_TABLE) == ACTIONS
    assert set(ACTION_PARAMS) == set(ACTIONS)
    assert {a.name for a in ACTION_TABLE if a.applies != "rank"} == SUPERVISOR_ACTIONS
    assert {a.name for a in ACTION_TABLE if a.applies == "rank"} <= set(APPLIERS)
    assert all(a.does for a in ACTION_TABLE)


def _decide(action: str, tmp_path: Path) -> Any:
    params = EXAMPLE_PARAMS.get(action, {})
    policy = {
        "version": 1,
        "name": "one-action",
        "rules": [{"name": "r", "when": {"anomaly": "loss_spike"}, "do": [{action: params}]}],
    }
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps(policy))  # JSON is YAML
    assert [d for d in check_policy(path) if d.severity == "error"] == []
    engine = Engine(load_policy(path), run_id="t")
    (decision,) = engine.decide([AnomalyEvent(kind="loss_spike", rank=0, step=3, tick=3)], now=0.0)
    assert decision.action == action and decision.reason
    return decision


def _guard(run_dir: Path) -> Guard:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    return Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b), b.sum(1, keepdim=True)),
        data=lambda i: torch.randn(8, 4, generator=torch.Generator().manual_seed(i)),
        max_steps=6,
        config=GuardConfig(checkpoint_every=100, detectors=[]),
        run_dir=run_dir,
    )


def _loop_guard(run_dir: Path) -> LoopGuard:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    guard = LoopGuard(model, detectors=[], run_dir=run_dir)
    guard.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    return guard


def _drive(guard: LoopGuard, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        guard.begin_step()
        x = torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(guard.model(x), x.sum(1, keepdim=True))
        guard.record_loss(loss)
        loss.backward()
        guard.before_optimizer_step()
        guard.optimizer.step()
        guard.optimizer.zero_grad(set_to_none=True)
        guard.end_step()
    guard.close()


@pytest.mark.parametrize("spec", ACTION_TABLE, ids=lambda a: a.name)
def test_every_action_is_checked_decided_applied_and_has_an_outcome(
    spec: Any, tmp_path: Path
) -> None:
    """Rank actions apply on a Guard and under the callbacks (or fail with the table's sentence)."""
    decision = _decide(spec.name, tmp_path)
    if spec.applies != "rank":
        controller = Controller(Engine(load_policy(tmp_path / "policy.yaml"), run_id="t"),
                                world_size=1)  # fmt: skip
        event = {"kind": "loss_spike", "rank": 0, "step": 3, "tick": 3}
        controller.ingest({"rank": 0, "step": 4, "tick": 4, "events": [event]})
        controller.finish()
        assert [d["action"] for d in controller.decisions][:1] == [spec.name]
        assert all(d["outcome"] and d["reason"] for d in controller.decisions)
        return
    for target in ("guard", "callbacks"):
        cmd = Command.from_decision(decision, apply_at_step=1, apply_at_tick=1, seq=1)
        if target == "guard":
            guard = _guard(tmp_path / "guard")
            guard.submit(cmd)
            for batch in guard:
                guard.step(batch)
            history = list(guard.history)
        else:
            loop = _loop_guard(tmp_path / "loop")
            loop.submit(cmd)
            _drive(loop, 4)
            history = list(loop.history)
        (outcome,) = history
        if target == "callbacks" and spec.under_callbacks is not None:
            assert (outcome.outcome, outcome.detail) == ("failed", spec.under_callbacks)
            assert REFUSED_UNDER_FRAMEWORKS[spec.name] == spec.under_callbacks
        elif spec.name in NEEDS_AN_ANOMALY:
            assert outcome.outcome == "failed"
            assert NEEDS_AN_ANOMALY[spec.name] in outcome.detail
        elif spec.name in NEEDS_HERE and not torch.cuda.is_available():
            assert outcome.outcome == "failed"
            assert NEEDS_HERE[spec.name] in outcome.detail
        else:
            assert outcome.outcome == "applied", (target, outcome.detail)
        assert "Error" not in outcome.detail


class _SpikeAt:
    """A detector that reports one loss spike, at the step of tick `tick` (a rollback's
    steps run again at later ticks: it fires once), and says so before that step's update
    (`flags`: the Guard then keeps the state from before it, which `replay_step` re-runs)."""

    name = "spike_at"

    def __init__(self, tick: int) -> None:
        self.tick = tick
        self._next_tick = 0

    def flags(self, loss: float, grad_norm: float, *, scaled: bool) -> bool:
        return self._next_tick == self.tick

    def observe(self, stats: StepStats) -> list[AnomalyEvent]:
        self._next_tick = stats.tick + 1
        if stats.tick != self.tick:
            return []
        return [event(stats, "loss_spike", value=stats.loss, threshold=0.0)]

    def reset(self) -> None:
        pass


SPIKE_TICK = 2
STEPS = 10
# A single process has no worker group: the supervisor's restart of a rank fails there, saying so
# (tests/supervisor covers it under `remedy run`).
NEEDS_A_GROUP = {"restart_rank": "restart_rank needs a worker group; none is attached"}
# What each applied action did, read from its journaled result: a real outcome, not a name.
DID: dict[str, Any] = {
    "rollback": lambda r, run: r["restored_step"] <= SPIKE_TICK,
    "shrink_lr": lambda r, run: r["lr_scale"] == 0.5 and r["lr_after"][0] < r["lr_before"][0],
    "enable_activation_checkpointing": lambda r, run: r["wrapped"] != [],
    "switch_kv_allocator": lambda r, run: r["allocator_after"] == "paged",
    "skip_batches": lambda r, run: r["skipped_count"] == 2,
    "reduce_microbatch": lambda r, run: r["micro_batches_after"] == 2,
    "checkpoint_now": lambda r, run: Path(r["path"]).exists(),
    "dump_diagnostics": lambda r, run: Path(r["path"]).exists(),
    "notify": lambda r, run: True,  # journaled as applied: the supervisor told the log
    "abort": lambda r, run: run["status"] == "aborted" and run["steps_completed"] < STEPS,
    "rescale_grad_scaler": lambda r, run: r["scale_after"] == r["scale_before"] * 0.5,
    "configure_cuda_allocator": lambda r, run: r["settings"] == "expandable_segments:True",
    "replay_step": lambda r, run: (
        (r["verdict"]["kind"], r["verdict"]["step"]) == ("replay_reproducible", SPIKE_TICK)
    ),
}


def _policy_file(action: str, tmp_path: Path) -> Path:
    params = EXAMPLE_PARAMS.get(action, {})
    policy = {
        "version": 1,
        "name": "one-action",
        "rules": [{"name": "r", "when": {"anomaly": "loss_spike"}, "do": [{action: params}]}],
    }
    path = tmp_path / f"{action}.yaml"
    path.write_text(json.dumps(policy))  # JSON is YAML
    return path


def _scaler(on: bool) -> Any:
    """An enabled GradScaler (on the CPU as torch allows) for the action that rescales one."""
    return torch.amp.GradScaler("cpu", init_scale=1024.0) if on else None


def _run_guard(policy: Path, run_dir: Path, *, scaler: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        scaler=_scaler(scaler),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b), b.sum(1, keepdim=True)),
        data=lambda i: torch.randn(8, 4, generator=torch.Generator().manual_seed(i)),
        max_steps=STEPS,
        config=GuardConfig(
            checkpoint_every=100, detectors=[_SpikeAt(SPIKE_TICK)], policy=str(policy)
        ),
        run_dir=run_dir,
    )
    for batch in guard:
        guard.step(batch)
    return guard.summary


class _Regression(lightning.LightningModule):  # type: ignore[misc]
    """The same tiny model and data as the Guard's, as a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return nn.functional.mse_loss(self.net(x), x.sum(1, keepdim=True))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _run_callbacks(policy: Path, run_dir: Path, *, scaler: bool) -> dict[str, Any]:
    """A real `lightning.Trainer` under the callback; with a GradScaler, Lightning's fp16
    precision plugin holding one (on the CPU, given to it)."""
    from remedy.integrations.lightning import RemedyCallback  # noqa: PLC0415 - Lightning's

    module = _Regression()
    x = torch.randn(8 * 4 * STEPS, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    callback = RemedyCallback(policy=str(policy), run_dir=run_dir, detectors=[_SpikeAt(SPIKE_TICK)])
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=_scaler(True))] if scaler else []
    trainer = quiet_trainer(
        STEPS, [callback], plugins=plugins, default_root_dir=str(run_dir.parent)
    )
    trainer.fit(module, data)
    assert callback.guard is not None
    return callback.guard.close()  # what on_train_end returned: close is idempotent


@pytest.mark.parametrize("loop", ["guard", "callbacks"])
@pytest.mark.parametrize("spec", ACTION_TABLE, ids=lambda a: a.name)
def test_every_action_walks_check_decide_apply_outcome_through_the_journal(
    spec: Any, loop: Loop, tmp_path: Path
) -> None:
    """A detector's event, the policy's decision, the command through the shared inbox, the
    applier, the outcome back to the controller and its line in decisions.jsonl: on a Guard
    and under the Lightning callback in a real `lightning.Trainer`. `policy check --loop` refuses beforehand exactly the
    actions that fail under the callbacks, with the sentence the journal then gives."""
    policy = _policy_file(spec.name, tmp_path)
    refused = loop == "callbacks" and spec.under_callbacks is not None
    errors = [d for d in check_policy(policy, loop=loop) if d.severity == "error"]
    assert [spec.under_callbacks in d.message for d in errors] == ([True] if refused else [])
    run_dir = tmp_path / "run"
    run = _run_guard if loop == "guard" else _run_callbacks
    summary = run(policy, run_dir, scaler=spec.name == "rescale_grad_scaler")
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    first = decisions[0]
    assert (first["action"], first["anomaly"]["kind"], first["rule"]) == (
        spec.name,
        "loss_spike",
        "r",
    )
    detail, result = first["detail"], first.get("result", {})
    if refused:
        assert (first["outcome"], detail) == ("failed", spec.under_callbacks)
    elif spec.name in NEEDS_A_GROUP:
        assert (first["outcome"], detail) == ("failed", NEEDS_A_GROUP[spec.name])
    elif spec.name == "configure_cuda_allocator" and not torch.cuda.is_available():
        assert first["outcome"] == "failed" and NEEDS_HERE[spec.name] in detail
    else:
        assert first["outcome"] == "applied", (loop, detail)
        assert DID[spec.name](result, summary), (loop, result, summary)
    assert "Error" not in detail
