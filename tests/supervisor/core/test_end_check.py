"""Ranks at their last step may end only once nothing on their steps is owed (`control.end_check`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remedy.control.decide import Controller
from remedy.control.end_check import may_end
from remedy.policies import AnomalyEvent, Decision, Engine, load_policy
from remedy.rundir.writer import RunDir
from tests.supervisor.core.carried import Carried


def _controller(tmp: Path, restarts: list[Decision]) -> Controller:
    def group_action(d: Decision) -> tuple[str, str] | None:
        restarts.append(d)
        return None  # under way; resolved later, as a real restart is

    engine = Engine(load_policy("default"), run_id="r")
    return Carried(engine, world_size=2, files=RunDir(tmp, "r"), group_action=group_action)


def _applied(command: dict[str, Any], rank: int, step: int) -> dict[str, Any]:
    return {"decision_id": command["decision_id"], "rank": rank, "outcome": "applied",
            "step": step, "tick": step, "detail": "", "result": {}}  # fmt: skip


def test_a_quiet_run_may_end_once_every_rank_reported_its_last_step(tmp_path: Path) -> None:
    """Nothing decided: the last tick is settled once both ranks reported past it."""
    c = _controller(tmp_path, [])
    c.ingest({"rank": 0, "step": 10, "tick": 10})
    assert not may_end(c, 9), "rank 1 has not reported its last step"
    c.ingest({"rank": 1, "step": 10, "tick": 10})
    assert may_end(c, 9)


def test_a_spike_held_behind_a_restart_keeps_the_ranks_until_its_rollback_is_applied(
    tmp_path: Path,
) -> None:
    """A rank restart under way, a spike's rollback held back behind it, then that rollback
    given out and answered: the ranks at their last step may end only after the answers."""
    restarts: list[Decision] = []
    c = _controller(tmp_path, restarts)
    hang = AnomalyEvent("rank_hang", 1, 8, tick=8, source="supervisor")
    c.ingest({"rank": 0, "step": 8, "tick": 8})
    c.ingest({"rank": 1, "step": 8, "tick": 8})
    c.handle(c.engine.decide([hang], now=1.0))
    c.carry()  # its shell starts the restart
    assert [d.action for d in restarts] == ["restart_rank"] and c.deferred
    spike = AnomalyEvent("loss_spike", 0, 8, tick=8, value=13.0, threshold=3.0)
    c.ingest({"rank": 0, "step": 10, "tick": 10, "events": [spike.to_dict()]})
    c.ingest({"rank": 1, "step": 10, "tick": 10})
    assert c.settled(9), "every report is in: the spike is decided (held back)"
    assert c.engine.holding_back and not c.pending
    assert not may_end(c, 9), "the restart is under way and the spike's rollback is held"
    c.resolve_group_action(restarts[0].decision_id, "applied", "replaced rank 1")
    assert not c.deferred and not c.engine.holding_back
    commands = c.commands_for(0)
    assert "rollback" in [cmd["action"] for cmd in commands], commands
    assert not may_end(c, 9), "the rollback is given out, not answered"
    for rank in (0, 1):
        c.ingest({"rank": rank, "step": 10, "tick": 11, "outcomes": [
            _applied(cmd, rank, 10) for cmd in commands]})  # fmt: skip
    assert not c.pending
    assert may_end(c, 10), "every command answered, nothing held: the ranks may end"
