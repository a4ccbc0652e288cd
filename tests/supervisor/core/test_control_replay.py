"""The controller turns a replay's classification into an anomaly, decides it, and answers the ranks.

The ranks hold at their boundary after a replay; the controller's answer is a
`<decision>-answer` command sent after the commands the policy decided, naming
the ranks a restart replaces. These tests drive the controller with the
outcomes ranks send (the verdict is what `workers.replay.classify` returns).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remedy.control.decide import Controller
from remedy.policies import AnomalyEvent, Decision, Engine, load_policy_text
from remedy.rank.actions.replay import classify
from remedy.rundir.writer import RunDir, read_jsonl
from tests.supervisor.core.carried import Carried

POLICY = """
version: 1
name: replay-test
rules:
  - name: replay-first
    when: {anomaly: [nonfinite_grad, loss_spike]}
    group_by: [node]
    do: [replay_step]
    max_fires: 1
    on_exhausted: notify
  - name: chip
    when: {anomaly: [replay_transient, replay_rank_specific]}
    do:
      - restart_rank: {}
      - notify: {message: "cordon the node"}
  - name: data
    when: {anomaly: replay_reproducible}
    do:
      - rollback: {steps_back: 10, skip_batches: 20}
"""
NODES = {0: "10.0.0.1", 1: "10.0.0.2"}


def _controller(tmp: Path, restarts: list[Decision]) -> Controller:
    def group_action(d: Decision) -> tuple[str, str] | None:
        restarts.append(d)
        return None  # under way; resolved later

    engine = Engine(load_policy_text(POLICY, "p.yaml"), run_id="r")
    return Carried(engine, world_size=2, files=RunDir(tmp, "r"), group_action=group_action,
                   nodes=NODES)  # fmt: skip


def _run(loss: float, bits: list[int]) -> dict[str, Any]:
    return {"loss": loss, "bits": bits, "total": float(sum(bits)), "mag": float(sum(bits))}


def _verdict(kind: str) -> dict[str, Any]:
    """A classification as the ranks make it, for a fault on rank 1 at step 7.

    Each rank's numbers: rank 1's original step, both ranks' re-run, and rank 1's
    batch alone on rank 1 then on rank 0 (`checked`).
    """
    clean, bad = _run(2.5, [11, 12]), _run(2.5, [11, 99])
    orig, again1, again0, mine, theirs = {
        "replay_transient": (bad, clean, clean, clean, clean),
        "replay_rank_specific": (bad, bad, clean, bad, clean),
        "replay_reproducible": (bad, bad, bad, bad, bad),
    }[kind]
    table = [
        {"kept": False, "orig": None, "replay": again0, "checked": theirs, "names": ["a", "b"]},
        {"kept": True, "orig": orig, "replay": again1, "checked": mine, "names": ["a", "b"]},
    ]
    verdict = classify(step=7, table=table, suspect=1, witness=0, tolerance=0.0, source=1)
    assert verdict["kind"] == kind, verdict["reason"]
    return {**verdict, "replay_s": 0.2}


def _replay_command(c: Controller) -> dict[str, Any]:
    grad = AnomalyEvent("nonfinite_grad", 1, 7, value=float("inf"), severity="critical")
    c.ingest({"rank": 1, "step": 8, "tick": 8, "events": [grad.to_dict()]})
    (command,) = c.ingest({"rank": 0, "step": 8, "tick": 8})  # the incident waited for rank 0
    assert command["action"] == "replay_step"
    return command


def _outcome(command: dict[str, Any], rank: int, verdict: Any) -> dict[str, Any]:
    result = {"verdict": verdict} if verdict is not None else {}
    return {"decision_id": command["decision_id"], "rank": rank, "outcome": "applied",
            "step": 7, "tick": 9, "detail": "", "result": result}  # fmt: skip


def test_a_transient_answer_restarts_the_rank_and_the_ranks_wait_for_the_group(
    tmp_path: Path,
) -> None:
    """replay_transient on rank 1: restart_rank [1] and notify; the answer names rank 1 to wait for."""
    restarts: list[Decision] = []
    c = _controller(tmp_path, restarts)
    command = _replay_command(c)
    verdict = _verdict("replay_transient")
    c.ingest({"rank": 0, "step": 7, "tick": 9, "outcomes": [_outcome(command, 0, verdict)]})
    assert restarts == [], "the replay is not resolved before every rank's outcome"
    answers = c.ingest(
        {"rank": 1, "step": 7, "tick": 9, "outcomes": [_outcome(command, 1, verdict)]}
    )
    (answer,) = [a for a in answers if a["decision_id"].endswith("-answer")]
    assert answer["action"] == "replay_step"
    assert answer["params"]["answer"] == {
        "classification": "replay_transient",
        "actions": [
            {"action": "restart_rank", "rule": "chip", "ranks": [1]},
            {"action": "notify", "rule": "chip", "ranks": [1]},
        ],
        "restart": [1],
    }
    [restart] = restarts
    assert restart.anomaly.kind == "replay_transient" and restart.anomaly.node == "10.0.0.2"
    assert restart.anomaly.details["replay_decision"] == command["decision_id"]
    anomalies = read_jsonl(tmp_path / "anomalies.jsonl")
    assert [(a["kind"], a["rank"], a["details"]["node"]) for a in anomalies] == [
        ("nonfinite_grad", 1, "10.0.0.2"),
        ("replay_transient", 1, "10.0.0.2"),
    ]
    journal = read_jsonl(tmp_path / "decisions.jsonl")
    assert [(d["action"], d["outcome"]) for d in journal] == [
        ("replay_step", "applied"),
        ("notify", "applied"),
    ]
    assert journal[0]["result"]["verdict"]["evidence"]["witness_check"]["batch_of"] == 1
    # The answer is owed to both ranks until they apply it; it is never journaled.
    assert [a["decision_id"] for a in c.commands_for(0)] == [answer["decision_id"]]
    for rank in (0, 1):
        done = {**_outcome(answer, rank, None), "detail": "answer: restart_rank (chip)"}
        c.ingest({"rank": rank, "step": 7, "tick": 9, "outcomes": [done]})
    assert c.commands_for(0) == c.commands_for(1) == []
    assert len(read_jsonl(tmp_path / "decisions.jsonl")) == 2
    assert c.rejected == {}


def test_a_reproducible_answer_rolls_back_before_the_answer(tmp_path: Path) -> None:
    """replay_reproducible: the rollback is dispatched first, the answer after it (higher seq)."""
    c = _controller(tmp_path, [])
    command = _replay_command(c)
    verdict = _verdict("replay_reproducible")
    c.ingest({"rank": 0, "step": 7, "tick": 9, "outcomes": [_outcome(command, 0, verdict)]})
    owed = c.ingest({"rank": 1, "step": 7, "tick": 9, "outcomes": [_outcome(command, 1, verdict)]})
    assert [(a["action"], a["decision_id"].endswith("-answer")) for a in owed] == [
        ("rollback", False),
        ("replay_step", True),
    ]
    assert owed[0]["seq"] < owed[1]["seq"]
    assert owed[0]["anomaly_step"] == 7
    assert owed[1]["params"]["answer"]["restart"] == []


def test_a_result_without_a_classification_still_answers(tmp_path: Path) -> None:
    """A verdict the controller cannot read (an older rank, a bad record) decides nothing, but the
    ranks are still told, so none waits for its full time."""
    c = _controller(tmp_path, [])
    command = _replay_command(c)
    bad = {"kind": "replay_sideways", "rank": 1, "step": 7}
    for rank in (0, 1):
        owed = c.ingest(
            {"rank": rank, "step": 7, "tick": 9, "outcomes": [_outcome(command, rank, bad)]}
        )
    (answer,) = owed
    assert answer["params"]["answer"] == {"classification": None, "actions": [], "restart": []}
    assert [a["kind"] for a in read_jsonl(tmp_path / "anomalies.jsonl")] == ["nonfinite_grad"]


def test_a_rank_lost_while_the_ranks_wait_is_not_waited_for(tmp_path: Path) -> None:
    """The answer closes once every live rank applied it; the lost one is dropped, no rejection."""
    c = _controller(tmp_path, [])
    command = _replay_command(c)
    verdict = _verdict("replay_transient")
    for rank in (0, 1):
        owed = c.ingest(
            {"rank": rank, "step": 7, "tick": 9, "outcomes": [_outcome(command, rank, verdict)]}
        )
    (answer,) = [a for a in owed if a["decision_id"].endswith("-answer")]
    c.drop_rank(1)
    c.ingest({"rank": 0, "step": 7, "tick": 9, "outcomes": [_outcome(answer, 0, None)]})
    assert answer["decision_id"] not in c.pending
    c.finish()
    # The restart resolves through the worker group, not here: the journal holds the rest.
    assert [d["action"] for d in read_jsonl(tmp_path / "decisions.jsonl")] == [
        "replay_step",
        "notify",
    ]
    assert c.rejected == {}


def test_a_flagged_tick_is_settled_once_every_rank_reported_it_and_it_is_decided(
    tmp_path: Path,
) -> None:
    """Ranks holding at a flagged step's boundary (workers.flag_hold) wait for `settled`."""
    c = _controller(tmp_path, [])
    grad = AnomalyEvent("nonfinite_grad", 1, 7, value=float("inf"), severity="critical")
    assert not c.settled(7), "no rank has reported"
    c.ingest({"rank": 1, "step": 8, "tick": 8, "events": [grad.to_dict()]})
    assert not c.settled(7), "rank 0 has not reported step 7: the incident is held"
    assert c.settled(6) is False, "an earlier tick waits for rank 0's report too"
    c.incomplete = frozenset({0})
    assert c.ingest({"rank": 0, "step": 8, "tick": 8}) == []
    assert not c.settled(7), "rank 0 has reports still on their way: nothing is decided yet"
    c.incomplete = frozenset()
    (command,) = c.ingest({"rank": 0, "step": 8, "tick": 8})
    assert c.settled(7) and c.settled(6)
    assert command["action"] == "replay_step", "the decision is in the reply that settles it"
    assert not c.settled(8), "step 8 is not reported yet"
    c.ingest({"rank": 0, "step": 9, "tick": 9})
    c.ingest({"rank": 1, "step": 9, "tick": 9})
    assert c.settled(8), "a tick with nothing to decide settles as it is reported"
