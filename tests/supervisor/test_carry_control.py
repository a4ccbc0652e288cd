"""The supervisor carries out what its control state asked, in order, and answers it (`carry_control`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remedy.control.decide import Controller
from remedy.control.effects import Notify
from remedy.control.job import JobStateMachine, Started
from remedy.policies import AnomalyEvent, Decision, Engine, load_policy_text
from remedy.rundir.writer import RunDir, read_jsonl
from remedy.supervisor.carry_control import RankNodes, carry_control

POLICY = """
version: 1
name: carry
rules:
  - name: tell
    when: {anomaly: loss_spike}
    do: [notify]
  - name: replace
    when: {anomaly: [rank_hang, rank_dead]}
    do: [restart_rank]
"""


def _controller() -> Controller:
    c = Controller(
        Engine(load_policy_text(POLICY, "carry.yaml"), run_id="r"),
        world_size=2,
        group_actions=True,
        notify=True,
        nodes=RankNodes({0: "node-a"}.get, 2),
    )
    c.incidents.hold_s = 0.0  # decided on its first report (incidents are tested elsewhere)
    return c


def _batch(kind: str, rank: int, step: int) -> dict[str, Any]:
    ev = AnomalyEvent(kind, rank, step, tick=step, severity="critical", source="supervisor")
    return {"rank": rank, "step": step, "tick": step, "events": [ev.to_dict()]}


def test_a_notification_is_sent_and_its_answer_journaled(tmp_path: Path) -> None:
    """A `notify` decision leaves as a `Notify`; the shell's answer resolves it, journaled once,
    and the anomaly carries its rank's node from the mapping."""
    c, files, sent = _controller(), RunDir(tmp_path, "r"), []

    def notify(effect: Notify) -> tuple[str, str]:
        sent.append(effect)
        return "applied", "sent to the webhook"

    c.ingest(_batch("loss_spike", 0, 5), now=100.0)
    assert [d["action"] for d in c.decisions] == []  # nothing carried yet: nothing resolved
    assert not carry_control(c, JobStateMachine(), files, notify=notify, group_action=_never)
    [effect] = sent
    assert effect.rule == "tell" and not c.notifying and not c.effects
    [line] = read_jsonl(tmp_path / "decisions.jsonl")
    assert (line["action"], line["outcome"], line["detail"]) == (
        "notify",
        "applied",
        "sent to the webhook",
    )
    [anomaly] = read_jsonl(tmp_path / "anomalies.jsonl")
    assert anomaly["details"]["node"] == "node-a"


def test_a_group_action_under_way_is_answered_later_and_one_done_at_once_now(
    tmp_path: Path,
) -> None:
    """A restart that goes on stays deferred until its end is answered; one the shell refuses
    at once is resolved in the same carry."""
    c, files = _controller(), RunDir(tmp_path, "r")
    started: list[Decision] = []

    def under_way(d: Decision) -> tuple[str, str] | None:
        started.append(d)
        return None

    c.ingest(_batch("rank_hang", 1, 7), now=100.0)
    carry_control(c, JobStateMachine(), files, notify=_never, group_action=under_way)
    [d] = started
    assert d.action == "restart_rank" and list(c.deferred) == [d.decision_id]
    c.resolve_group_action(d.decision_id, "applied", "replaced rank 1")
    carry_control(c, JobStateMachine(), files, notify=_never, group_action=under_way)
    c.ingest(_batch("rank_dead", 0, 8), now=101.0)
    carry_control(
        c, JobStateMachine(), files, notify=_never, group_action=lambda _: ("failed", "no group")
    )
    assert not c.deferred
    outcomes = [(r["ranks"], r["outcome"]) for r in read_jsonl(tmp_path / "decisions.jsonl")]
    assert outcomes == [([1], "applied"), ([0], "failed")]
    resolved = [r for r in read_jsonl(tmp_path / "history.jsonl") if r["type"] == "resolved"]
    assert [r["outcome"] for r in resolved] == ["applied", "failed"]


def test_a_job_move_is_journaled_and_asks_for_a_state_record(tmp_path: Path) -> None:
    """The job's moves go to the history, once, and say the shell must write a state record."""
    c, files, job = _controller(), RunDir(tmp_path, "r"), JobStateMachine()
    job.step(Started(0))
    assert carry_control(c, job, files, notify=_never, group_action=_never)
    assert not carry_control(c, job, files, notify=_never, group_action=_never)
    [moved] = read_jsonl(tmp_path / "history.jsonl")
    assert (moved["type"], moved["to"]["phase"]) == ("job_state", "running")


def test_rank_nodes_holds_only_the_ranks_whose_node_is_known() -> None:
    """A rank whose node is not learnt yet is not in the mapping (its anomaly is not stamped)."""
    nodes = RankNodes({1: "node-b"}.get, 3)
    assert dict(nodes) == {1: "node-b"} and nodes.get(0) is None and nodes.get(7) is None


def _never(_: Any) -> tuple[str, str]:
    raise AssertionError("not expected here")
