"""Ranks that report through their node's agent: a NaN remediated once, results as without agents."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.rundata import load_run
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
# 60 steps after the NaN: a decision on the step-30 incident is made on the report of the
# rank that reports it last, and a rank whose own report of it was answered before learns
# the command with its next report, one heartbeat (0.5 s) later. With 30 steps after the
# NaN (the test's first form), steps of under 17 ms ended the run before that report: the
# rollback failed ("the run ended before the ranks reported an outcome") in the run
# reporting directly, once on a clean clone (2026-12-06) after many passing runs.
STEPS = 90
ARGS = ["--steps", str(STEPS), "--layers", "2", "--width", "64", "--sample-every", "0"]
FAULTS = [{"kind": "nan_loss", "at_step": 30, "rank": 1}]


def _run(run_dir: Path, agents: str) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(run_dir), faults=FAULTS, argv=ARGS, node_agents=agents
    )
    return run_supervised(spec)


def _decisions(run_dir: Path) -> list[tuple[Any, ...]]:
    return [
        (d["action"], d["step"], d["outcome"], d["anomaly"]["rank"], json.dumps(d["params"]))
        for d in read_jsonl(run_dir / "decisions.jsonl")
    ]


@pytest.mark.slow
def test_two_ranks_through_an_agent_match_the_run_without(
    ray_cluster: None, tmp_path: Path
) -> None:
    """With agents forced on, the rollback is decided once and applied on both ranks; the
    decisions, steps and final parameters equal those of the same run reporting directly."""
    on, off = tmp_path / "agents", tmp_path / "direct"
    with_agents = _run(on, "on")
    direct = _run(off, "off")
    assert with_agents["status"] == direct["status"] == "completed"
    history = read_jsonl(on / "history.jsonl")
    assert [r["type"] for r in history].count("agents_started") == 1
    assert not any(r["type"] == "agents_started" for r in read_jsonl(off / "history.jsonl"))
    # The step records are in the agent's file, not in metrics.jsonl, and a report reads them.
    (agent_file,) = on.glob("metrics-agent-*.jsonl")
    assert read_jsonl(agent_file) and not read_jsonl(on / "metrics.jsonl")
    assert {m["rank"] for m in load_run(on).metrics} == {0, 1}
    # Decided once, applied once on every rank: the rollback's outcome is "applied", and
    # both runs decided the same things at the same steps.
    assert _decisions(on) == _decisions(off)
    rollback = next(d for d in read_jsonl(on / "decisions.jsonl") if d["action"] == "rollback")
    assert rollback["outcome"] == "applied"
    resolved = [r for r in history if r["type"] == "resolved"]
    assert [r["decision_id"] for r in resolved].count(rollback["decision_id"]) == 1

    # Both ranks rolled back at the same boundary (which one depends on timing, with or
    # without agents: the snapshot restored and the batches skipped do not).
    records = load_run(on).metrics
    by_rank = {r: [(m["tick"], m["step"]) for m in records if m["rank"] == r] for r in (0, 1)}
    assert by_rank[0] == by_rank[1]
    assert with_agents["rejected"] == direct["rejected"] == {}
    for a, b in zip(with_agents["ranks"], direct["ranks"], strict=True):
        assert a["steps_completed"] == b["steps_completed"] == STEPS
        assert a["steps_executed"] > STEPS and b["steps_executed"] > STEPS
        assert a["result"]["params_digest"] == b["result"]["params_digest"]


def test_a_flagged_step_is_held_for_through_the_agent(ray_cluster: None, tmp_path: Path) -> None:
    """Under llm-pretrain the ranks hold at a flagged step's boundary (workers.flag_hold); the
    agent sends their holding reports on at once and answers when the supervisor has settled
    the step, so the replay runs at the very next boundary, as without agents."""
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp_path), argv=ARGS, node_agents="on",
        policy="llm-pretrain", threads_per_rank=1,
        faults=[{"kind": "bitflip", "at_step": 25, "rank": 1, "target": "grad"}],
        spares=0,  # a transient flip is replayed, no rank is lost: no warm spare to start
    )  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    decisions = read_jsonl(tmp_path / "decisions.jsonl")
    replay = next(d for d in decisions if d["action"] == "replay_step")
    assert replay["outcome"] == "applied", replay["detail"]
    holds = [r.get("flag_holds") for r in summary["ranks"]]  # what each rank's hold did
    assert replay["anomaly"]["step"] == 25 and replay["applied_at_step"] == 26, (replay, holds)
    assert replay["result"]["verdict"]["kind"] == "replay_transient"
