"""A whole node lost: on a real 3-node Ray cluster, `kill_node` takes the node holding two of
four ranks away; both are replaced on the other node and every rank ends as in a clean run."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from remedy.rundir.writer import read_jsonl
from remedy.supervisor.agent.actor import agent_files
from tests.supervisor.multinode import Cluster, local_cluster

pytestmark = [pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
STEPS = 30
ARGS = ["--steps", str(STEPS), "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip
KILL_STEP = 15
VICTIM = 1  # spread over two worker nodes: ranks 1 and 3 share a node


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head (the driver's and the supervisor's node) and two worker nodes, 2 CPUs each."""
    root = Path(tempfile.mkdtemp(prefix="nl-", dir="/tmp"))  # short: Ray's socket paths are bounded
    with local_cluster(root, workers=2, head_cpus=2, worker_cpus=2) as c:
        yield c


def supervised(cluster: Cluster, run_dir: Path, **spec: Any) -> dict[str, Any]:
    """A 4-rank run of the example on `cluster`, driven from a process of its own."""
    fields = {
        "target": TARGET, "workers": 4, "run_dir": str(run_dir), "argv": ARGS,
        "threads_per_rank": 1, "hang_watch": {"first_step_s": 20.0}, **spec,
    }  # fmt: skip
    out = cluster.head.run(
        sys.executable, "-m", "tests.supervisor.cluster_run", cluster.head.address,
        json.dumps(fields), timeout=400, cwd=REPO,
    )  # fmt: skip
    line = next((x for x in out.stdout.splitlines() if x.startswith("SUMMARY ")), None)
    assert line is not None, (out.stdout[-3000:], out.stderr[-5000:])
    summary: dict[str, Any] = json.loads(line.removeprefix("SUMMARY "))
    return summary


@pytest.fixture(scope="module")
def clean_digest(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameters' digest of the same run without faults; ranks spread over the worker nodes."""
    summary = supervised(cluster, tmp_path_factory.mktemp("clean"), spares=0)
    assert summary["status"] == "completed", summary
    workers = {w.node_id[:8] for w in cluster.workers}
    on = {r: n.split("@")[0] for r, n in summary["nodes"].items()}
    # Off the supervisor's (head) node, two ranks on each worker node.
    assert sorted(on.values()) == sorted([*workers, *workers]), (on, workers)
    assert on["1"] == on["3"] != on["0"] == on["2"]
    digests = {r["result"]["params_digest"] for r in summary["ranks"]}
    assert len(digests) == 1
    return digests.pop()


def node_loss_times(run_dir: Path, summary: dict[str, Any]) -> dict[str, float]:
    """Seconds from the kill to the node's loss being found, and to every rank's next step."""
    history = read_jsonl(run_dir / "history.jsonl")
    [kill] = [r for r in history if r.get("type") == "chaos_kill_node"]
    [lost] = [r for r in history if r.get("type") == "node_lost"]
    [record] = summary["recoveries"]
    return {
        "detect_s": round(lost["detected_at"] - kill["at"], 3),
        "kill_to_step_s": round(record["stepped_at"] - kill["at"], 3),
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_node_loses_two_ranks_both_replaced_on_the_other_node(
    cluster: Cluster, clean_digest: str, tmp_path: Path
) -> None:
    """kill_node on rank 1's node -> node_lost for ranks 1 and 3 -> one restart_rank replaces
    both from warm spares on the surviving node; parameters equal the clean run's, bit for bit."""
    fault = {"kind": "kill_node", "at_step": KILL_STEP, "rank": VICTIM}
    summary = supervised(cluster, tmp_path, spares=4, faults=[fault])
    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [STEPS] * 4
    assert {r["result"]["params_digest"] for r in ranks} == {clean_digest}
    history = read_jsonl(tmp_path / "history.jsonl")
    [kill] = [r for r in history if r.get("type") == "chaos_kill_node"]
    assert kill["outcome"] == "killing" and kill["ranks"] == [1, 3]
    [lost] = [r for r in history if r.get("type") == "node_lost"]
    assert lost["node_id"] == kill["node_id"] and lost["ranks"] == [1, 3]
    assert "Ray's GCS lists it dead" in lost["reason"]
    decisions = read_jsonl(tmp_path / "decisions.jsonl")
    # One restart for both: the first sign may be a rank's own silence, found before Ray's
    # verdict on its node; the node's other rank then joins the same restart.
    [restart] = [d for d in decisions if d["action"] == "restart_rank"]
    assert restart["anomaly"]["kind"] in ("node_lost", "rank_hang", "rank_dead"), restart
    assert restart["outcome"] == "applied", restart
    [record] = summary["recoveries"]
    assert sorted(record["ranks"]) == [1, 3]
    assert set(record["replacements"].values()) == {"warm spare"}, record
    # Every rank now runs on the surviving worker node: none on the dead one, none on the head.
    survivor = next(w.node_id[:8] for w in cluster.workers if w.node_id != kill["node_id"])
    assert {n.split("@")[0] for n in summary["nodes"].values()} == {survivor}
    print("node loss, warm spares:", node_loss_times(tmp_path, summary))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_node_without_spares_starts_both_ranks_cold_on_the_other_node(
    cluster: Cluster, clean_digest: str, tmp_path: Path
) -> None:
    """The same node loss with no warm spare: both ranks are new actors on the surviving node.

    Runs after the warm test, whose victim node is dead: a fresh node takes its place first."""
    cluster.replace_dead_workers()
    fault = {"kind": "kill_node", "at_step": KILL_STEP, "rank": VICTIM}
    summary = supervised(cluster, tmp_path, spares=0, faults=[fault])
    assert summary["status"] == "completed", summary
    assert {r["result"]["params_digest"] for r in summary["ranks"]} == {clean_digest}
    [lost] = [r for r in read_jsonl(tmp_path / "history.jsonl") if r.get("type") == "node_lost"]
    assert lost["ranks"] == [1, 3]
    [record] = summary["recoveries"]
    assert record["replacements"] == {"1": "new actor", "3": "new actor"}, record
    print("node loss, cold:", node_loss_times(tmp_path, summary))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_node_with_node_agents_on(cluster: Cluster, clean_digest: str, tmp_path: Path) -> None:
    """The same node loss with the ranks reporting through node agents: the kill is asked of the
    supervisor itself (not of the agent), the node's agent dies with it, and both ranks are
    replaced on the other node; parameters equal the clean run's, bit for bit."""
    cluster.replace_dead_workers()
    fault = {"kind": "kill_node", "at_step": KILL_STEP, "rank": VICTIM}
    summary = supervised(cluster, tmp_path, spares=4, faults=[fault], node_agents="on")
    assert summary["status"] == "completed", summary
    assert {r["result"]["params_digest"] for r in summary["ranks"]} == {clean_digest}
    history = read_jsonl(tmp_path / "history.jsonl")
    assert [r["type"] for r in history].count("agents_started") == 1
    [kill] = [r for r in history if r.get("type") == "chaos_kill_node"]
    assert kill["outcome"] == "killing" and kill["ranks"] == [1, 3]
    [record] = summary["recoveries"]
    assert sorted(record["ranks"]) == [1, 3]
    print("node loss, warm spares, node agents:", node_loss_times(tmp_path, summary))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_hang_on_one_node_is_found_by_the_agents_with_node_agents_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    """hang_rank on rank 1 with the ranks spread over two worker nodes and node agents on: the
    agents ping their own ranks, the supervisor names rank 1 from their sightings
    (`found_by: agent`), replaces it alone, and the run completes."""
    cluster.replace_dead_workers()
    fault = {"kind": "hang_rank", "at_step": KILL_STEP, "rank": VICTIM}
    summary = supervised(cluster, tmp_path, spares=2, faults=[fault], node_agents="on")
    assert summary["status"] == "completed", summary
    history = read_jsonl(tmp_path / "history.jsonl")
    [started] = [r for r in history if r["type"] == "agents_started"]
    assert len(started["nodes"]) == 3
    [restart] = [d for d in read_jsonl(tmp_path / "decisions.jsonl")
                 if d["action"] == "restart_rank"]  # fmt: skip
    assert restart["outcome"] == "applied" and restart["ranks"] == [VICTIM], restart
    assert restart["anomaly"]["kind"] == "rank_hang"
    assert restart["anomaly"]["details"]["found_by"] == "agent", restart["anomaly"]
    assert [r["steps_completed"] for r in summary["ranks"]] == [STEPS] * 4
    # The hung process (on a worker node) was killed by pid by its node's agent.
    assert summary["agent_kills"] == 1, summary["agent_kills"]


def _wait_for(what: str, found: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while (got := found()) is None:
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g}s"
        time.sleep(0.2)
    return got


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_that_joins_during_the_run_gets_an_agent_and_the_lost_ranks_report_through_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    """With node agents on, a node that joins the cluster while the run goes on gets its agent
    (journaled, `joined_late`); a worker node then killed loses its two ranks, which are placed
    on the new node, the least loaded, and report through its agent."""
    cluster.replace_dead_workers()
    history = tmp_path / "history.jsonl"

    def journaled(late: bool) -> dict[str, Any] | None:
        return next((r for r in read_jsonl(history) if r.get("type") == "agents_started"
                     and bool(r.get("joined_late")) is late), None)  # fmt: skip

    long = [*ARGS[:1], "1000", *ARGS[2:]]  # long enough for a node to join before the kill
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(supervised, cluster, tmp_path, spares=0, node_agents="on", argv=long)
        _wait_for("agents at the start", lambda: journaled(False), 180)
        root = Path(tempfile.mkdtemp(prefix="nj-", dir="/tmp"))
        joined = cluster.add_worker("w9", root)
        late = _wait_for("agent for the node that joined", lambda: journaled(True), 120)
        assert late["nodes"] == [joined.node_id]
        victim = next(w for w in cluster.workers if w is not joined)
        victim.kill()
        summary = run.result(timeout=600)
    assert summary["status"] == "completed", summary
    [lost] = [r for r in read_jsonl(history) if r.get("type") == "node_lost"]
    assert lost["node_id"] == victim.node_id and len(lost["ranks"]) == 2
    [record] = summary["recoveries"]
    assert sorted(record["ranks"]) == lost["ranks"]
    assert {summary["nodes"][str(r)].split("@")[0] for r in lost["ranks"]} == {joined.node_id[:8]}
    _, metrics = agent_files(tmp_path, joined.node_id)
    through = {m["rank"] for m in read_jsonl(tmp_path / metrics) if "rank" in m}
    assert through == set(lost["ranks"]), through


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_that_held_every_rank_is_lost_and_the_whole_group_restarts_elsewhere(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two ranks packed on one worker node, durable checkpoints every 5 steps; kill_node at step
    15 leaves no survivor to take the state from. The whole group restarts at once (no targeted
    attempt) on the other worker node from the newest checkpoint both ranks committed, and the
    run completes with the parameters of a fault-free run."""
    cluster.replace_dead_workers()
    argv = [*ARGS, "--checkpoint-every", "5"]
    spec = {"workers": 2, "placement": "pack", "argv": argv, "spares": 2}
    clean = supervised(cluster, tmp_path_factory.mktemp("packed-clean"), **spec)
    assert clean["status"] == "completed", clean
    [digest] = {r["result"]["params_digest"] for r in clean["ranks"]}
    run_dir = tmp_path_factory.mktemp("packed")
    fault = {"kind": "kill_node", "at_step": KILL_STEP, "rank": 1}
    summary = supervised(cluster, run_dir, faults=[fault], **spec)
    assert summary["status"] == "completed", summary
    assert [r["steps_completed"] for r in summary["ranks"]] == [STEPS] * 2
    assert {r["result"]["params_digest"] for r in summary["ranks"]} == {digest}
    history = read_jsonl(run_dir / "history.jsonl")
    [kill] = [r for r in history if r.get("type") == "chaos_kill_node"]
    assert kill["ranks"] == [0, 1], kill
    states = [r for r in history if r.get("type") == "job_state"]
    # The ranks may be found lost one by one (their own deaths) or together (the node's).
    phases = [r["to"]["phase"] for r in states]
    phases = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    assert phases == ["running", "recovering", "restarting-all", "running", "finished"], states
    # At once: one failed targeted restart (no survivor to take the state from), no retries.
    [failed] = [r for r in states if r["input"] == "RestartFailed"]
    assert failed["to"]["attempts"] == 1 and "cannot work" in failed["reason"], failed
    [full] = [r for r in history if r.get("type") == "full_restart"]
    assert full["resume_step"] in (10, 15), full  # the newest both committed before the kill
    # On the worker nodes left (one, or more where an earlier test added a node): none on the
    # killed node, none on the head.
    left = {w.node_id[:8] for w in cluster.workers if w.node_id != kill["node_id"]}
    on = {n.split("@")[0] for n in summary["nodes"].values()}
    assert on and on <= left, (on, left)
