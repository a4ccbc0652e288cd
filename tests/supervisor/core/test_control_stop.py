"""An operator's stop: a final `checkpoint_now` on every rank, then the ranks' loops end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from remedy.control.decide import Controller
from remedy.policies import Engine, load_policy
from remedy.rundir.writer import RunDir, read_jsonl
from tests.supervisor.core.carried import Carried


@pytest.fixture
def controller(tmp_path: Path) -> Controller:
    return Carried(
        Engine(load_policy("default"), run_id="r"),
        world_size=2,
        files=RunDir(tmp_path, "r"),
    )


def _outcome(decision_id: str, rank: int, result: str = "applied") -> dict[str, Any]:
    return {"decision_id": decision_id, "rank": rank, "outcome": result, "step": 8, "tick": 8}


def test_stop_sends_checkpoint_then_stop_to_every_rank(
    controller: Controller, tmp_path: Path
) -> None:
    """Both ranks get checkpoint_now, then abort with the stop's reason, in that sequence order."""
    for rank in (0, 1):
        controller.ingest({"rank": rank, "step": 7, "tick": 7})
    assert controller.stop("remedy stop")
    for rank in (0, 1):
        commands = controller.ingest({"rank": rank, "step": 7, "tick": 7})
        assert [(c["action"], c["decision_id"]) for c in commands] == [
            ("checkpoint_now", "r-operator"),
            ("abort", "r-operator-stop"),
        ]
        assert commands[0]["seq"] < commands[1]["seq"]
        assert commands[1]["params"]["reason"] == "remedy stop"
        assert commands[0]["apply_at_step"] == 8
    assert controller.stop_reason == "remedy stop" and controller.abort_reason is None
    assert not controller.stop("again"), "a second stop changes nothing"
    assert controller.stop_reason == "remedy stop"


def test_stop_checkpoint_outcome_is_journaled(controller: Controller, tmp_path: Path) -> None:
    """The final checkpoint is one decision of rule `remedy stop`; once both ranks answered,
    nothing is pending."""
    controller.ingest({"rank": 0, "step": 7, "tick": 7})
    controller.stop("remedy stop")
    for rank in (0, 1):
        outcomes = [_outcome("r-operator", rank), _outcome("r-operator-stop", rank)]
        controller.ingest({"rank": rank, "step": 8, "tick": 8, "outcomes": outcomes})
    assert controller.pending == {}
    (record,) = read_jsonl(tmp_path / "decisions.jsonl")
    assert (record["rule"], record["action"], record["outcome"]) == (
        "remedy stop",
        "checkpoint_now",
        "applied",
    )
    assert "an operator stopped the run" in record["reason"]
    assert controller.rejected == {}


def test_no_stop_while_a_policy_abort_is_under_way(controller: Controller) -> None:
    """An abort decided by the policy already ends the run: a stop then is refused."""
    controller.abort_reason = "aborted by policy"
    assert not controller.stop("remedy stop")
    assert controller.stop_reason is None and controller.pending == {}
