"""A rank's process lost while its node lives: its node's agent promotes a warm spare of that node.

The run keeps a local spare (`local_spares=1`) and reports through node agents; `kill_rank`
SIGKILLs rank 1's process. The agent waits for the process to be gone and starts the spare
as rank 1 (`NodeAgent.promote`), the spare's `run` being the agent's call; the agent is then
SIGKILLed too, and the promoted rank trains on: its run does not depend on the agent's
process, and the supervisor follows its end through `result`.
"""

from __future__ import annotations

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

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
# Long enough after the kill for the agent's own kill and restart to fall inside the run: a
# new agent process takes seconds on 2 busy cores.
STEPS = 200
ARGS = ["--steps", str(STEPS), "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip
# Late enough for the agent to have written its state record (after its first digest with
# items, up to a digest period after the first report). At step 30 the promotion came first
# in one run of four: the agent had made one call upward and rank 1 had reported no step to
# it yet, so the agent, killed then, rightly came back with no record to restore.
KILL = {"kind": "kill_rank", "at_step": 100, "rank": 1}


def _spec(run_dir: Path, faults: list[dict[str, Any]]) -> RunSpec:
    return RunSpec(
        target=TARGET, workers=2, run_dir=str(run_dir), faults=faults, argv=ARGS,
        threads_per_rank=1, node_agents="on", spares=0, local_spares=1,
    )  # fmt: skip


def _kill_agent_after_promotion(spec: RunSpec, out: dict[str, Any]) -> None:
    """Once the agent promoted a spare, SIGKILL the agent's process; note when and what."""
    agent = agent_once_at(spec, 5, 300)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        stats = ray.get(agent.stats.remote(), timeout=60)
        if stats["promotions"]:
            os.kill(stats["pid"], signal.SIGKILL)
            out["records"] = {
                p.name: p.read_text()[:500] for p in Path(spec.run_dir).glob("agent-*")
            }
            out["killed_at_step"] = agent_steps_seen(Path(spec.run_dir), rank=1)
            out["before"] = stats
            break
        time.sleep(0.05)
    while time.monotonic() < deadline:  # Ray restarts it from its state record
        try:
            after = ray.get(agent.stats.remote(), timeout=10)
        except ray.exceptions.RayError:
            time.sleep(0.1)
            continue
        if after["pid"] != out["before"]["pid"]:
            out["after"] = after
            return
        time.sleep(0.1)


@pytest.mark.slow
def test_a_killed_rank_is_replaced_by_its_nodes_spare_which_outlives_the_agent(
    ray_cluster: None, tmp_path: Path
) -> None:
    clean = run_supervised(_spec(tmp_path / "clean", []))
    assert clean["status"] == "completed", clean
    [digest] = {r["result"]["params_digest"] for r in clean["ranks"]}

    spec = _spec(tmp_path / "killed", [KILL])
    seen: dict[str, Any] = {}
    killer = threading.Thread(target=_kill_agent_after_promotion, args=(spec, seen))
    killer.start()
    summary = run_supervised(spec)
    killer.join(timeout=120)

    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [STEPS] * 2
    assert [r["steps_executed"] for r in ranks] == [STEPS] * 2  # none lost
    assert {r["result"]["params_digest"] for r in ranks} == {digest}
    assert ranks[1]["incarnation"] == 2
    [restart] = [d for d in read_jsonl(tmp_path / "killed" / "decisions.jsonl")
                 if d["action"] == "restart_rank"]  # fmt: skip
    assert restart["outcome"] == "applied" and restart["ranks"] == [1], restart
    [record] = summary["recoveries"]
    assert record["replacements"] == {"1": "local spare, promoted by its node's agent"}, record
    assert summary["agent_promotions"] == 1
    assert record["promoted"]["1"]["gone_s"] >= 0, record  # the agent's answer, kept
    # The agent was killed after the promotion and before the run ended, and came back.
    assert seen.get("after") is not None, seen
    assert seen["killed_at_step"] < STEPS - 1, seen
    assert seen["after"]["restored"] and seen["after"]["promotions"] == 0, seen
    print(
        "promoted:",
        record["replacements"],
        "detect -> every rank stepped:",
        record["detect_to_step_s"],
        "s; agent killed at rank 1's step",
        seen["killed_at_step"],
    )
