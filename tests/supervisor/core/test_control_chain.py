"""A chain whose step says `on_failure: next`, through the real Controller: each step once."""

from __future__ import annotations

from pathlib import Path

from remedy.policies import AnomalyEvent, Engine, load_policy_text
from remedy.rundir.writer import RunDir, read_jsonl
from tests.supervisor.core.carried import Carried

POLICY = """
version: 1
rules:
  - name: spike
    when: {anomaly: loss_spike}
    do:
      - checkpoint_now:
        on_failure: next
      - rollback: {steps_back: 5}
      - notify: {message: rolled back}
"""


def test_failed_step_with_next_is_journaled_failed_and_rest_runs_once(tmp_path: Path) -> None:
    """checkpoint_now fails: journaled `failed`, rollback still dispatched, notify applied once."""
    engine = Engine(load_policy_text(POLICY, "chain.yaml"), run_id="r")
    controller = Carried(engine, world_size=1, files=RunDir(tmp_path, "r"))
    event = AnomalyEvent("loss_spike", 0, 5, value=9.0).to_dict()
    commands = controller.ingest({"rank": 0, "step": 5, "tick": 5, "events": [event]})
    assert [c["action"] for c in commands] == ["checkpoint_now", "rollback"]
    assert [c["continue_on_failure"] for c in commands] == [True, False]
    ids = {c["action"]: c["decision_id"] for c in commands}
    failed = {"decision_id": ids["checkpoint_now"], "rank": 0, "outcome": "failed", "step": 6}
    left = controller.ingest({"rank": 0, "step": 6, "tick": 6, "outcomes": [failed | {"tick": 6}]})
    assert [c["action"] for c in left] == ["rollback"]
    applied = {"decision_id": ids["rollback"], "rank": 0, "outcome": "applied", "step": 7}
    assert controller.ingest({"rank": 0, "step": 7, "outcomes": [applied | {"tick": 7}]}) == []
    journal = [(r["action"], r["outcome"]) for r in read_jsonl(tmp_path / "decisions.jsonl")]
    assert sorted(journal) == [
        ("checkpoint_now", "failed"),
        ("notify", "applied"),
        ("rollback", "applied"),
    ]
