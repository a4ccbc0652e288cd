"""Every action of the table: policy check -> decide -> apply -> outcome, on a Guard and under the callbacks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remedy.integrations._loop import REFUSED_UNDER_FRAMEWORKS, LoopGuard
from remedy.policies import AnomalyEvent, Engine, check_policy, load_policy
from remedy.policies._params import ACTION_PARAMS
from remedy.policies._vocab import ACTION_TABLE, ACTIONS, SUPERVISOR_ACTIONS
from remedy.supervisor.core.control import Controller
from remedy.workers import Guard, GuardConfig
from remedy.workers.actions import APPLIERS
from remedy.workers.commands import Command

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]

# Parameters for actions whose defaults name nothing to act on.
EXAMPLE_PARAMS: dict[str, dict[str, Any]] = {
    "configure_cuda_allocator": {"expandable_segments": True},
    "enable_activation_checkpointing": {"modules": ["Linear"]},
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
