"""A supervisor SIGSTOPped under node agents is found hung, killed and restarted; nothing is lost."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import NAMESPACE, RunSpec, supervisor_name
from remedy.rank.link import liveness
from remedy.rundir.writer import read_jsonl
from remedy.supervisor.actor import launch_supervisor
from remedy.supervisor.agent.actor import HEARTBEAT_S, alive_nodes, kill_agents, upward_bound
from remedy.supervisor.worker_group import kill_run_actors
from tests.supervisor.runs import agent_once_at
from tests.supervisor.test_supervisor_restart_e2e import (
    ARGS,
    NAN,
    TARGET,
    _assert_survived,
    _decisions,
)

pytestmark = [pytest.mark.ray]

STOP_AT_STEP = 150
SILENCE_S = 3.0  # the run's `supervisor_timeout_s`: the liveness bound of every watcher


def _spec(run_dir: Path) -> RunSpec:
    return RunSpec(
        target=TARGET, workers=2, run_dir=str(run_dir), faults=[NAN], argv=ARGS,
        threads_per_rank=1, spares=0, supervisor_timeout_s=SILENCE_S, node_agents="on",
    )  # fmt: skip


def _stop_supervisor_at(spec: RunSpec, step: int, seen: dict[str, Any]) -> None:
    """SIGSTOP the run's supervisor, for good, once a rank reported `step` to its agent; note the
    agent's process before and after (a watcher that mistakes the agent for the hung one kills it)."""
    deadline = time.monotonic() + 120
    agent = agent_once_at(spec, step, 120)
    seen["agent_before"] = ray.get(agent.stats.remote(), timeout=30)
    sup = ray.get_actor(supervisor_name(spec.run_id), namespace=NAMESPACE)
    pid = ray.get(sup.where.remote(), timeout=30)[1]
    os.kill(pid, signal.SIGSTOP)
    seen["stopped_at"] = time.time()
    seen["pid"] = pid
    # Once the supervisor answers again (restarted), the agent's process then.
    while time.monotonic() < deadline:
        try:
            if ray.get(sup.where.remote(), timeout=1)[1] != pid:
                seen["back_at"] = time.time()
                seen["agent_after"] = ray.get(agent.stats.remote(), timeout=30)
                return
        except ray.exceptions.RayError:
            time.sleep(0.1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("configured", [None, 3.0, 60.0])
def test_an_agent_gives_a_call_up_only_after_the_supervisor_is_given_up(
    configured: float | None,
) -> None:
    """An upward call's bound outlasts the silence bound, the kill and Ray's restart: the watch
    (the agent's, the driver's) gives a hung supervisor up before any call to it fails."""
    silence = liveness.silence_bound(HEARTBEAT_S, configured)
    assert upward_bound(silence) > silence + liveness.RESTART_S + 1.0


@pytest.fixture(scope="module")
def agents_baseline(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same 2-rank run through agents without the stop: (decisions, summary)."""
    run_dir = tmp_path_factory.mktemp("clean_agents")
    t0 = time.time()
    summary = run_supervised(_spec(run_dir))
    assert summary["status"] == "completed" and summary["supervisor_restarts"] == 0
    return _decisions(run_dir), {**summary, "driver_wall_s": round(time.time() - t0, 1)}


def _stopped(spec: RunSpec, run: Callable[[RunSpec], dict[str, Any]]) -> tuple[Any, ...]:
    """`run(spec)` with its supervisor SIGSTOPped at `STOP_AT_STEP`: (summary, seen, wall_s)."""
    seen: dict[str, Any] = {}
    thread = threading.Thread(
        target=_stop_supervisor_at, args=(spec, STOP_AT_STEP, seen), daemon=True
    )
    t0 = time.time()
    thread.start()
    summary = run(spec)
    thread.join(timeout=30)
    assert "pid" in seen, "the supervisor was never stopped"
    return summary, seen, round(time.time() - t0, 1)


def _assert_outage(run_dir: Path, summary: dict[str, Any], seen: dict[str, Any]) -> dict[str, Any]:
    """The stopped supervisor was killed by pid past the bound (the agent was not killed in its
    place), and summary.json and the journal say so; the killer's note."""
    (outage,) = summary["supervisor_outages"]
    assert outage["how"].startswith(f"killed its process (pid {seen['pid']}, SIGKILL) by "), outage
    assert outage["duration_s"] > outage["noticed_after_s"], outage
    agents = {f"agent {n[:12]}" for n in alive_nodes()}
    assert set(outage["noticed_by"]) <= {"driver", "rank 0", "rank 1"} | agents, outage
    assert summary["supervisor_outage_s"] == outage["duration_s"]
    notes = [
        r["note"] for r in read_jsonl(run_dir / "history.jsonl") if r["type"] == "supervisor_outage"
    ]
    assert notes and all(n["ended"] is not None for n in notes)
    # The merged outage begins with the earliest note (a rank's report held at its agent may
    # have gone out first); the watcher that killed counted a silence of its bound at least.
    # (Two watchers may both kill within the same instant; the outage names one.)
    killers = [n for n in notes if n["killed"] is not None]
    assert killers and all(k["noticed"] - k["began"] >= SILENCE_S for k in killers), killers
    (killer,) = [k for k in killers if outage["how"].endswith(f"by {k['noticed_by']}")][:1]
    # The agent was not taken for the hung supervisor: the same process throughout.
    assert seen["agent_after"]["pid"] == seen["agent_before"]["pid"], seen
    assert seen["back_at"] - seen["stopped_at"] < 60, seen
    return killer


def _record(wall_s: float, seen: dict[str, Any], summary: dict[str, Any], base: Any) -> None:
    """What happened, for the record (`pytest -s`)."""
    print(
        json.dumps({
            "wall_s": wall_s, "baseline_wall_s": base[1]["driver_wall_s"],
            "back_after_stop_s": round(seen.get("back_at", 0) - seen["stopped_at"], 1),
            "outage": summary.get("supervisor_outages"),
            "agent_pids": [seen.get(k, {}).get("pid") for k in ("agent_before", "agent_after")],
        })
    )  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_stopped_supervisor_under_agents_is_killed_restarted_and_the_outage_recorded(
    agents_baseline: Any, tmp_path: Path
) -> None:
    """Agents on, supervisor SIGSTOPped at step 150 of 2 ranks, the driver following: it is found
    silent past the bound (by the driver or the agent) and killed by pid, Ray restarts it; every
    step is trained, the NaN at 200 rolled back once, decisions as without the stop, and
    summary.json and the journal record the outage and who noticed it."""
    summary, seen, wall_s = _stopped(_spec(tmp_path), run_supervised)
    _record(wall_s, seen, summary, agents_baseline)
    _assert_survived(tmp_path, summary, agents_baseline, 2)
    _assert_outage(tmp_path, summary, seen)


def _unwatched(spec: RunSpec, timeout_s: float) -> dict[str, Any]:
    """Run `spec` as a detached run is left alone: no driver polls its supervisor, so only the
    ranks and agents can find it hung; the summary it writes (within `timeout_s`)."""
    summary_path = Path(spec.run_dir) / "summary.json"
    sup = launch_supervisor(spec)
    try:
        ray.get(sup.start.remote(), timeout=120)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                summary = json.loads(summary_path.read_text())
            except (OSError, ValueError):
                summary = None
            if isinstance(summary, dict) and summary.get("status") != "running":
                # The outages' notes may land after the summary is first written: read again.
                time.sleep(1.0)
                return dict(json.loads(summary_path.read_text()))
            time.sleep(0.2)
        raise TimeoutError(f"the run did not end within {timeout_s:g}s")
    finally:
        ray.kill(sup, no_restart=True)
        kill_run_actors(spec.run_id)
        kill_agents(spec.run_id, alive_nodes())


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_stopped_supervisor_of_a_run_no_driver_follows_is_found_by_its_agent(
    agents_baseline: Any, tmp_path: Path
) -> None:
    """As above with no driver polling (a detached run): the ranks' reports go to their agent,
    which answers most of them itself, so only the agent sees the supervisor silent; it kills
    it past the bound, Ray restarts it, and the run ends as without the stop."""
    summary, seen, wall_s = _stopped(_spec(tmp_path), lambda spec: _unwatched(spec, 200))
    _record(wall_s, seen, summary, agents_baseline)
    _assert_survived(tmp_path, summary, agents_baseline, 2)
    killer = _assert_outage(tmp_path, summary, seen)
    assert killer["noticed_by"].startswith("agent "), killer
