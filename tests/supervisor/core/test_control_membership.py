"""Membership-aware commands: a lost rank leaves pending commands; restart_rank is not held behind them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from remedy.control.decide import Controller
from remedy.policies import AnomalyEvent, Decision, Engine, load_policy_text
from remedy.rundir.writer import RunDir, read_jsonl
from tests.supervisor.core.carried import Carried

POLICY = """
version: 1
name: membership-test
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do: [rollback: {steps_back: 10}]
  - name: rank-restart
    when: {anomaly: [rank_hang, rank_dead]}
    do: [restart_rank]
"""


@pytest.fixture
def deferred() -> list[Decision]:
    return []


@pytest.fixture
def controller(tmp_path: Path, deferred: list[Decision]) -> Controller:
    def group_action(d: Decision) -> None:
        deferred.append(d)  # carried out asynchronously, like the supervisor's restart

    engine = Engine(load_policy_text(POLICY, "membership.yaml"), run_id="r")
    c = Carried(engine, world_size=4, files=RunDir(tmp_path, "r"), group_action=group_action)
    # Not a test of merging one incident across ranks (tests/policies/test_incidents.py,
    # test_restore_table.py): an incident is decided on its first report.
    c.incidents.hold_s = 0.0
    return c


def _event(kind: str, rank: int, step: int) -> dict[str, Any]:
    return AnomalyEvent(kind, rank, step, severity="critical", source="supervisor").to_dict()


def _applied(decision_id: str, rank: int) -> dict[str, Any]:
    return {"decision_id": decision_id, "rank": rank, "outcome": "applied", "step": 6, "tick": 6}


def test_a_decision_resolves_when_every_live_target_answered(
    controller: Controller, tmp_path: Path
) -> None:
    """Three ranks applied the rollback and the fourth died: dropping it resolves the decision."""
    [cmd] = controller.ingest(
        {"rank": 0, "step": 5, "tick": 5, "events": [_event("nonfinite_loss", 0, 5)]}
    )
    for rank in (0, 1, 2):
        controller.ingest(
            {"rank": rank, "step": 6, "tick": 6, "outcomes": [_applied(cmd["decision_id"], rank)]}
        )
    assert controller.pending
    controller.drop_rank(3)
    assert not controller.pending
    [record] = read_jsonl(tmp_path / "decisions.jsonl")
    assert record["action"] == "rollback" and record["outcome"] == "applied"


def test_restart_rank_preempts_a_rollback_waiting_on_a_dead_rank(
    controller: Controller, deferred: list[Decision], tmp_path: Path
) -> None:
    """A rollback nobody applied yet gives up the budget when rank 3 is lost; restart_rank then fires."""
    [cmd] = controller.ingest(
        {"rank": 0, "step": 5, "tick": 5, "events": [_event("nonfinite_loss", 0, 5)]}
    )
    assert controller.drop_rank(3) == [cmd["decision_id"]]
    controller.ingest({"rank": 3, "step": 5, "tick": 5, "events": [_event("rank_hang", 3, 5)]})
    assert [d.action for d in deferred] == ["restart_rank"]
    assert not [d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["outcome"] == "suppressed"]
    # The replacement still receives the rollback (it applies it unless the adopted state has it done).
    assert [c["decision_id"] for c in controller.commands_for(3)] == [cmd["decision_id"]]
    controller.resolve_group_action(deferred[0].decision_id, "applied", "replaced rank 3")
    restart = [d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["action"] == "restart_rank"]
    assert restart[0]["outcome"] == "applied" and restart[0]["detail"] == "replaced rank 3"
    # The rollback resolves once the live ranks report, without waiting for rank 3.
    for rank in (0, 1, 2):
        controller.ingest(
            {"rank": rank, "step": 6, "tick": 6, "outcomes": [_applied(cmd["decision_id"], rank)]}
        )
    assert not controller.pending


def test_without_the_drop_the_rollback_holds_the_budget(
    controller: Controller, deferred: list[Decision]
) -> None:
    """The deadlock the drop prevents: a rollback waiting on a dead rank suppresses restart_rank."""
    controller.ingest({"rank": 0, "step": 5, "tick": 5, "events": [_event("nonfinite_loss", 0, 5)]})
    controller.ingest({"rank": 3, "step": 5, "tick": 5, "events": [_event("rank_hang", 3, 5)]})
    assert deferred == []
