"""A node agent SIGKILLed mid-run: Ray restarts it, it rebuilds from its record, nothing is lost."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl
from tests.supervisor.runs import agent_once_at, agent_steps_seen

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
# Long enough for Ray to bring the agent back (a new process: seconds on 2 busy cores)
# before the fault; an anomaly sent while it is away reaches the supervisor when it is back.
STEPS = 400
ARGS = ["--steps", str(STEPS), "--layers", "2", "--width", "64", "--sample-every", "0"]
FAULTS = [{"kind": "nan_loss", "at_step": 300, "rank": 1}]
KILL_AT_STEP = 40


def _spec(run_dir: Path) -> RunSpec:
    return RunSpec(
        target=TARGET, workers=2, run_dir=str(run_dir), faults=FAULTS, argv=ARGS, node_agents="on"
    )


def _kill_agent_at(spec: RunSpec, step: int, out: dict[str, Any]) -> None:
    """SIGKILL this node's agent (by pid) once rank 0 reported `step`; note what was killed."""
    run_dir = Path(spec.run_dir)
    agent = agent_once_at(spec, step, 300, rank=0)
    before = ray.get(agent.stats.remote(), timeout=60)
    os.kill(before["pid"], signal.SIGKILL)
    out["killed_at_step"] = agent_steps_seen(run_dir, rank=0)
    out["before"] = before
    # Ray restarts it; its state record says what it had.
    for _ in range(600):
        try:
            after = ray.get(agent.stats.remote(), timeout=10)
        except ray.exceptions.RayError:
            time.sleep(0.1)
            continue
        if after["pid"] != before["pid"]:
            out["after"] = after
            return
        time.sleep(0.1)


def _decisions(run_dir: Path) -> list[tuple[Any, ...]]:
    return [
        (d["action"], d["step"], d["outcome"], d["anomaly"]["rank"], json.dumps(d["params"]))
        for d in read_jsonl(run_dir / "decisions.jsonl")
    ]


@pytest.mark.slow
def test_a_killed_agent_comes_back_and_the_run_matches_one_without_the_kill(
    ray_cluster: None, tmp_path: Path
) -> None:
    """The agent is SIGKILLed at step 40; the NaN at step 300 is still remediated once, and
    decisions, outcomes and final parameters equal those of the same run without the kill."""
    killed_spec = _spec(tmp_path / "killed")
    seen: dict[str, Any] = {}
    killer = threading.Thread(target=_kill_agent_at, args=(killed_spec, KILL_AT_STEP, seen))
    killer.start()
    killed = run_supervised(killed_spec)
    killer.join(timeout=120)
    plain = run_supervised(_spec(tmp_path / "plain"))
    assert seen.get("after") is not None, seen
    assert seen["after"]["restored"], "the restarted agent did not find its state record"
    assert sorted(seen["after"]["ranks"]) == [0, 1]
    assert seen["killed_at_step"] < 300  # the kill came before the fault
    assert killed["status"] == plain["status"] == "completed"
    assert _decisions(tmp_path / "killed") == _decisions(tmp_path / "plain")
    assert killed["outcomes"] == plain["outcomes"] == {"applied": 2}
    assert killed["actions"] == plain["actions"]
    for a, b in zip(killed["ranks"], plain["ranks"], strict=True):
        assert a["steps_completed"] == b["steps_completed"] == STEPS
        assert a["result"]["params_digest"] == b["result"]["params_digest"]
    # Every step of rank 0 reached the run directory (none lost with the agent).
    steps = {m["step"] for p in (tmp_path / "killed").glob("metrics-agent-*.jsonl")
             for m in read_jsonl(p) if m["rank"] == 0}  # fmt: skip
    assert set(range(STEPS)) <= steps
    assert killed["rejected"] == plain["rejected"] == {}
    # What the ranks saw of the kill was their agent's silence, not the supervisor's.
    ranks_noticed = [n for o in killed["supervisor_outages"] for n in o["noticed_by"]
                     if n.startswith("rank")]  # fmt: skip
    assert ranks_noticed == [], killed["supervisor_outages"]
    assert all(n.startswith("rank") for o in killed["agent_outages"] for n in o["noticed_by"])
