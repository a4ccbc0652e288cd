"""The controller validates input, journals before dispatch, and resolves decisions from rank outcomes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from remedy.control.decide import Controller
from remedy.control.effects import Notify
from remedy.policies import AnomalyEvent, Engine, load_policy_text
from remedy.rundir.writer import RunDir, read_jsonl
from tests.supervisor.core.carried import Carried

POLICY = """
version: 1
name: control-test
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 10, skip_batches: 0}
      - shrink_lr: {factor: 0.5}
    max_fires: 5
  - name: told
    when: {anomaly: data_stall}
    do: [notify]
  - name: stop
    when: {anomaly: gpu_ecc}
    do: [abort]
"""


@pytest.fixture
def controller(tmp_path: Path) -> Controller:
    engine = Engine(load_policy_text(POLICY, "control.yaml"), run_id="r")
    c = Carried(engine, world_size=2, files=RunDir(tmp_path, "r"))
    # These tests are about validation, journaling and dispatch, not about merging one
    # incident across ranks (tests/policies/test_incidents.py): an incident is decided on its
    # first report instead of waiting for the other rank's report of its tick.
    c.incidents.hold_s = 0.0
    return c


def nan(rank: int, step: int) -> dict[str, Any]:
    return AnomalyEvent(
        "nonfinite_loss", rank, step, value=float("nan"), severity="critical"
    ).to_dict()


def outcome(
    decision_id: str, rank: int, result: str = "applied", detail: str = ""
) -> dict[str, Any]:
    return {
        "decision_id": decision_id,
        "rank": rank,
        "outcome": result,
        "step": 6,
        "tick": 6,
        "detail": detail,
    }


def test_malformed_input_is_rejected_and_counted(controller: Controller) -> None:
    """Bad batches and bad events are counted and skipped; good events in the same batch still count."""
    assert controller.ingest("not a batch") == []
    assert controller.ingest({"rank": -1, "step": 3}) == []
    assert controller.ingest({"rank": True, "step": 3}) == []
    assert controller.rejected_batches == 3
    events = [
        {"kind": "nonsense", "rank": 0, "step": 1},
        {"kind": "nonfinite_loss"},
        "x",
        nan(0, 5),
    ]
    commands = controller.ingest({"rank": 0, "step": 5, "events": events})
    assert controller.rejected_events == 3
    assert [c["action"] for c in commands] == ["rollback", "shrink_lr"]


def test_write_ahead_then_journal_on_outcome(controller: Controller, tmp_path: Path) -> None:
    """A decision is a change before dispatch (the shell writes a state record holding it before
    a reply carries its command), in the history, and in decisions.jsonl once every rank
    reports."""
    changes = controller.changes
    commands = controller.ingest({"rank": 0, "step": 5, "tick": 5, "events": [nan(0, 5)]})
    assert controller.changes > changes
    assert {p.command.decision_id for p in controller.pending.values()} == {
        c["decision_id"] for c in commands
    }
    history = read_jsonl(tmp_path / "history.jsonl")
    assert [r["type"] for r in history] == ["decided", "decided"]
    assert read_jsonl(tmp_path / "decisions.jsonl") == []
    assert commands[0]["apply_at_tick"] == 6
    ids = [c["decision_id"] for c in commands]
    controller.ingest({"rank": 0, "step": 6, "outcomes": [outcome(i, 0) for i in ids]})
    assert read_jsonl(tmp_path / "decisions.jsonl") == []  # rank 1 has not reported yet
    assert [
        c["decision_id"] for c in controller.ingest({"rank": 1, "step": 6})
    ] == ids  # re-sent until acked
    controller.ingest({"rank": 1, "step": 6, "outcomes": [outcome(i, 1) for i in ids]})
    journal = read_jsonl(tmp_path / "decisions.jsonl")
    assert [(d["action"], d["outcome"]) for d in journal] == [
        ("rollback", "applied"),
        ("shrink_lr", "applied"),
    ]
    assert all(d["run_id"] == "r" and d["reason"] and d["ts"] for d in journal)
    assert not (tmp_path / "journal.wal").exists()  # the shell's: state records only
    assert [r["type"] for r in read_jsonl(tmp_path / "history.jsonl")][-2:] == [
        "resolved",
        "resolved",
    ]
    assert controller.commands_for(0) == [] and controller.commands_for(1) == []


def test_failed_step_ends_its_chain(controller: Controller, tmp_path: Path) -> None:
    """When a rank fails the rollback, the chain's later steps are not carried out and say why."""
    rollback, _ = (
        c["decision_id"] for c in controller.ingest({"rank": 0, "step": 5, "events": [nan(0, 5)]})
    )
    controller.ingest(
        {"rank": 0, "step": 6, "outcomes": [outcome(rollback, 0, "failed", "no snapshot")]}
    )
    journal = read_jsonl(tmp_path / "decisions.jsonl")
    assert [(d["action"], d["outcome"]) for d in journal] == [
        ("rollback", "failed"),
        ("shrink_lr", "suppressed"),
    ]
    assert journal[0]["detail"] == "no snapshot"
    assert controller.commands_for(1) == []


def test_notify_is_applied_by_the_supervisor(controller: Controller, tmp_path: Path) -> None:
    """notify needs no rank: it is journaled as applied at once and sends no command."""
    stall = AnomalyEvent("data_stall", 1, 9, value=3.0, threshold=2.5).to_dict()
    assert controller.ingest({"rank": 1, "step": 9, "events": [stall]}) == []
    (line,) = read_jsonl(tmp_path / "decisions.jsonl")
    assert (line["action"], line["outcome"]) == ("notify", "applied")


def test_notify_goes_to_the_sink_the_shell_gives(tmp_path: Path) -> None:
    """A notify decision is one `Notify` effect for the shell's sink; its answer is the outcome."""
    sent: list[Notify] = []

    def sink(effect: Notify) -> tuple[str, str]:
        sent.append(effect)
        return "failed", "webhook answered 503"

    engine = Engine(load_policy_text(POLICY, "control.yaml"), run_id="r")
    c = Carried(engine, world_size=2, files=RunDir(tmp_path, "r"), notify=sink)
    stall = AnomalyEvent("data_stall", 1, 9, value=3.0, threshold=2.5).to_dict()
    c.ingest({"rank": 1, "step": 9, "events": [stall]})
    [effect] = sent
    [line] = read_jsonl(tmp_path / "decisions.jsonl")
    assert (effect.decision_id, effect.rule, effect.reason) == (
        line["decision_id"],
        line["rule"],
        line["reason"],
    )
    assert (line["outcome"], line["detail"]) == ("failed", "webhook answered 503")


def test_abort_stops_every_rank(controller: Controller) -> None:
    """abort is journaled, sets the abort reason and sends a stop to every rank."""
    ecc = AnomalyEvent("gpu_ecc", 0, 4, value=1.0, source="hardware").to_dict()
    controller.ingest({"rank": 0, "step": 4, "events": [ecc]})
    assert controller.abort_reason
    for rank in (0, 1):
        assert [c["action"] for c in controller.commands_for(rank)] == ["abort"]


def test_finish_journals_unresolved_decisions(controller: Controller, tmp_path: Path) -> None:
    """Nothing is lost: decisions still pending at the end are journaled as failed with a reason."""
    controller.ingest({"rank": 0, "step": 5, "events": [nan(0, 5)]})
    controller.finish()
    journal = read_jsonl(tmp_path / "decisions.jsonl")
    assert [d["outcome"] for d in journal] == ["failed", "failed"]
    assert "before the ranks reported" in journal[0]["detail"]


def test_metrics_and_anomalies_are_recorded(controller: Controller, tmp_path: Path) -> None:
    """Metrics lines and validated anomalies land in their files; the loss feeds the summary."""
    metrics = [{"step": s, "rank": 0, "loss": 2.0 - 0.1 * s} for s in range(3)]
    controller.ingest({"rank": 0, "step": 3, "metrics": metrics, "events": [nan(0, 3)]})
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 3
    (anomaly,) = read_jsonl(tmp_path / "anomalies.jsonl")
    assert anomaly["kind"] == "nonfinite_loss" and anomaly["value"] == "nan"
    assert controller.final_loss(0) == pytest.approx(1.9)


def test_late_outcome_of_a_dropped_step_is_not_a_rejection(controller: Controller) -> None:
    """A rank's outcome for a chain step dropped after an earlier step failed is ignored, not counted;
    an outcome for an id never issued is counted."""
    rollback, shrink = (
        c["decision_id"] for c in controller.ingest({"rank": 0, "step": 5, "events": [nan(0, 5)]})
    )
    controller.ingest(
        {"rank": 0, "step": 6, "outcomes": [outcome(rollback, 0, "failed", "no snapshot")]}
    )
    controller.ingest({"rank": 1, "step": 6, "outcomes": [outcome(shrink, 1, "failed")]})
    assert controller.rejected == {}
    controller.ingest({"rank": 1, "step": 6, "outcomes": [outcome("r-d99999", 1)]})
    assert controller.rejected == {"outcome_unknown_decision": 1}


def test_a_rank_with_reports_still_on_their_way_holds_the_incident(tmp_path: Path) -> None:
    """After a supervisor restart Ray retries calls out of order: rank 0's newer report (tick 9)
    came before the one with its NaN loss at tick 7. Its tick alone would release rank 1's NaN
    gradient as the incident, and the NaN loss would come too late: the wrong remedy (an LR cut,
    no rollback). With rank 0 marked incomplete the incident waits for it."""
    policy = (
        POLICY
        + """  - name: nan-grad-cut
    when: {anomaly: nonfinite_grad}
    do: [{shrink_lr: {factor: 0.5}}]
"""
    )
    c = Carried(
        Engine(load_policy_text(policy, "control.yaml"), run_id="r"),
        world_size=2,
        files=RunDir(tmp_path, "r"),
    )
    grad = AnomalyEvent("nonfinite_grad", 1, 7, tick=7, value=float("nan"), severity="critical")
    c.ingest({"rank": 1, "step": 8, "tick": 8, "events": [grad.to_dict()]})
    c.incomplete = frozenset({0})  # rank 0's report of tick 7 has not come yet
    c.ingest({"rank": 0, "step": 9, "tick": 9, "events": []})
    assert not c.pending and c.incidents.holding == 1, "held: rank 0 may still report tick 7"
    c.incomplete = frozenset()
    loss = AnomalyEvent("nonfinite_loss", 0, 7, tick=7, value=float("nan"), severity="critical")
    c.ingest({"rank": 0, "step": 8, "tick": 8, "events": [loss.to_dict()]})
    decided = [p.decision for p in c.pending.values()]
    assert [(d.rule, d.action, d.anomaly.kind) for d in decided] == [
        ("nan-rollback", "rollback", "nonfinite_loss"),
        ("nan-rollback", "shrink_lr", "nonfinite_loss"),
    ]
    assert [(m["kind"], m["rank"]) for m in decided[0].anomaly.details["merged"]] == [
        ("nonfinite_grad", 1)
    ]


def test_a_full_restart_from_before_an_anomaly_settles_its_rewind_and_decides_it_anew(
    controller: Controller, tmp_path: Path
) -> None:
    """Every rank restarted from step 0 while a NaN's rollback was pending (a rank died first):
    the restart undid the steps after the NaN, so the rollback is applied by it and is not
    sent to the new ranks (which would rewind again at their first boundary and skip batches
    that were never bad); the chain's next step (shrink_lr) still goes to them. The NaN that
    comes again in the redone steps, at the same tick, is a new incident: decided anew, not
    merged into the one decided before the restart (seen under the Lightning callbacks, whose
    every rank loss is a full restart)."""
    first = controller.ingest({"rank": 0, "step": 14, "tick": 14, "events": [nan(0, 14)]})
    rollback, shrink = (c["decision_id"] for c in first)
    settled = controller.rewound(0, "from step 0")
    assert settled == [rollback]
    [line] = read_jsonl(tmp_path / "decisions.jsonl")
    assert (line["decision_id"], line["action"], line["outcome"]) == (
        rollback,
        "rollback",
        "applied",
    )
    assert line["detail"].startswith(
        "carried out by the full-group restart: every rank resumed from step 0"
    )
    assert [c["decision_id"] for c in controller.commands_for(1)] == [shrink]
    again = controller.ingest({"rank": 0, "step": 14, "tick": 14, "events": [nan(0, 14)]})
    assert [c["action"] for c in again if c["decision_id"] != shrink] == ["rollback", "shrink_lr"]
    assert not controller.incidents.late


def test_a_full_restart_from_a_checkpoint_after_the_anomaly_keeps_its_rewind() -> None:
    """A checkpoint newer than the anomaly already holds the rollback's result or will get it:
    a pending rollback of an earlier tick is not settled by the restart (it is re-issued)."""
    engine = Engine(load_policy_text(POLICY, "control.yaml"), run_id="r")
    c = Carried(engine, world_size=2)
    c.incidents.hold_s = 0.0
    c.ingest({"rank": 0, "step": 14, "tick": 14, "events": [nan(0, 14)]})
    assert c.rewound(20, "from checkpoint step 20") == []
    assert {p.decision.action for p in c.pending.values()} == {"rollback", "shrink_lr"}


def test_one_reply_for_many_ranks_owes_each_what_it_would_alone(controller: Controller) -> None:
    """An agent's reply (`commands_for_ranks`) gives each rank the commands `commands_for`
    gives it, one copy of each command shared by the ranks owing it, never the pending
    command itself; a report taken with `answer=False` is taken and answered with nothing."""
    assert controller.ingest({"rank": 1, "step": 3, "tick": 3}, answer=False) == []
    assert controller.step_of[1] == 3  # taken all the same
    first = controller.ingest({"rank": 0, "step": 5, "tick": 5, "events": [nan(0, 5)]})
    rollback, shrink = (c["decision_id"] for c in first)
    controller.ingest({"rank": 1, "step": 6, "tick": 6, "outcomes": [outcome(rollback, 1)]})
    reply = controller.commands_for_ranks([0, 1])
    assert reply == {0: controller.commands_for(0), 1: controller.commands_for(1)}
    assert [c["decision_id"] for c in reply[0]] == [rollback, shrink]
    assert [c["decision_id"] for c in reply[1]] == [shrink]
    assert reply[0][1] is reply[1][0]  # one copy of `shrink` in the reply
    reply[0][1]["params"]["factor"] = 0.0
    assert controller.commands_for(1)[0]["params"]["factor"] == 0.5
