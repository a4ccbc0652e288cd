"""A SIGKILLed supervisor is restarted by Ray and resumes from its journal: no decision lost or repeated."""

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
from remedy.control.record import fold
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl
from remedy.supervisor.actor import NAMESPACE, supervisor_name
from remedy.supervisor.worker_group import run_actor_names
from tests.supervisor.runs import finished

pytestmark = [pytest.mark.ray]

HERE = Path(__file__).resolve().parent
TARGET = f"{HERE / 'daemon_train.py'}:main"
STEPS = 260
# Slow steps after the NaN until its rollback is applied: the run outlasts the restart.
ARGS = ["--steps", str(STEPS), "--step-s", "0.03", "--await-after", "200", "--await-s", "1.0"]
NAN = {"kind": "nan_loss", "at_step": 200, "rank": 0}
KILL = {"kind": "kill_supervisor", "at_step": 150, "rank": 0}


def _run(tmp: Path, workers: int, faults: list[dict[str, Any]]) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=workers, run_dir=str(tmp), faults=faults, argv=ARGS,
        threads_per_rank=1, spares=0,
    )  # fmt: skip
    summary = run_supervised(spec)
    assert json.loads((tmp / "summary.json").read_text())["status"] == summary["status"]
    return summary


def _decisions(tmp: Path) -> list[tuple[Any, ...]]:
    """What was decided and how it went, without ids and timings (which differ between runs)."""
    return [
        (d["rule"], d["action"], d["anomaly"]["kind"], d["anomaly"]["rank"],
         d["anomaly"]["step"], json.dumps(d["params"], sort_keys=True), d["outcome"])
        for d in read_jsonl(tmp / "decisions.jsonl")
    ]  # fmt: skip


def _gone(run_id: str) -> bool:
    """True once neither the supervisor nor any rank actor of `run_id` is left on the cluster."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        if supervisor_name(run_id) not in names and not run_actor_names(run_id):
            return True
        time.sleep(0.2)
    return False


def _baseline(tmp: Path, workers: int) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
    summary = _run(tmp, workers, [NAN])
    assert summary["status"] == "completed" and summary["supervisor_restarts"] == 0
    return _decisions(tmp), summary


@pytest.fixture(scope="module")
def one_rank_baseline(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The 1-rank run without the kill: (decisions, summary)."""
    return _baseline(tmp_path_factory.mktemp("clean1"), 1)


@pytest.fixture(scope="module")
def two_rank_baseline(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The 2-rank run without the kill: (decisions, summary)."""
    return _baseline(tmp_path_factory.mktemp("clean2"), 2)


def _assert_survived(tmp: Path, summary: dict[str, Any], baseline: Any, workers: int) -> None:
    assert summary["status"] == "completed", summary
    assert summary["supervisor_restarts"] == 1
    assert json.loads((tmp / "summary.json").read_text())["supervisor_restarts"] == 1
    journal = read_jsonl(tmp / "history.jsonl")
    assert [r["incarnation"] for r in journal if r["type"] == "supervisor_started"] == [1, 2]
    assert {r["type"] for r in read_jsonl(tmp / "journal.wal")} <= {"state", "state_delta"}
    # Nothing lost, nothing repeated: the same decisions, outcomes and params as without the kill.
    decisions = read_jsonl(tmp / "decisions.jsonl")
    # In any order: which rank's report reaches the supervisor first varies from run to run.
    clean_decisions, clean_summary = baseline
    assert sorted(_decisions(tmp)) == sorted(clean_decisions)
    assert summary["actions"] == clean_summary["actions"]
    ids = [d["decision_id"] for d in decisions]
    assert len(ids) == len(set(ids))
    # The rollback for the NaN: journaled once before dispatch, resolved once, applied once per rank.
    rollbacks = [d for d in decisions if d["action"] == "rollback"]
    assert [d["outcome"] for d in rollbacks] == ["applied"]
    rollback_id = rollbacks[0]["decision_id"]
    decided = [r for r in journal if r["type"] == "decided"]
    assert [r["decision"]["decision_id"] for r in decided].count(rollback_id) == 1
    resolved = [r for r in journal if r["type"] == "resolved"]
    assert [r["decision_id"] for r in resolved].count(rollback_id) == 1
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [STEPS] * workers
    for rank in ranks:
        applied = [a for a in rank["result"]["applied"] if a["decision_id"] == rollback_id]
        assert [a["outcome"] for a in applied] == ["applied"], rank["result"]["applied"]
        # Every command the rank applied is a journaled decision, once.
        done = [a["decision_id"] for a in rank["result"]["applied"]]
        assert sorted(done) == sorted(set(done)) and set(done) <= set(ids)
    assert len({r["result"]["params_digest"] for r in ranks}) == 1
    assert _gone(summary["run_id"]), "the run's actors outlived it"


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_killed_supervisor_restarts_and_the_nan_rollback_applies_once(
    one_rank_baseline: Any, tmp_path: Path
) -> None:
    """kill_supervisor at step 150, NaN at 200, 1 rank -> completed; decisions as without the kill; restarts: 1."""
    summary = _run(tmp_path, 1, [KILL, NAN])
    _assert_survived(tmp_path, summary, one_rank_baseline, 1)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_killed_supervisor_of_two_ranks_loses_no_decision(
    two_rank_baseline: Any, tmp_path: Path
) -> None:
    """The same with 2 gloo ranks: both apply the rollback once, end bitwise equal, decisions as without the kill."""
    summary = _run(tmp_path, 2, [KILL, NAN])
    _assert_survived(tmp_path, summary, two_rank_baseline, 2)


def test_launch_supervisor_is_named_detached_and_restartable(
    ray_cluster: None, tmp_path: Path
) -> None:
    """launch_supervisor gives a named actor in the remedy namespace that Ray restarts after a kill."""
    from remedy.supervisor.actor import launch_supervisor  # noqa: PLC0415

    spec = RunSpec(target=TARGET, run_dir=str(tmp_path))
    sup = launch_supervisor(spec)
    try:
        found = ray.get_actor(supervisor_name(spec.run_id), namespace=NAMESPACE)
        assert ray.get(found.status.remote(spec.token))["state"] == "starting"
        ray.kill(sup, no_restart=False)  # as a crash: Ray restarts it, the handle still works
        assert ray.get(sup.status.remote(spec.token), timeout=60)["run_id"] == spec.run_id
    finally:
        ray.kill(sup, no_restart=True)


@pytest.mark.timeout(120)
def test_wait_survives_a_restart_after_the_run_ended(ray_cluster: None, tmp_path: Path) -> None:
    """A supervisor restarted after its run ended answers `wait` with the same summary, read back from the run."""
    from remedy.supervisor.actor import launch_supervisor  # noqa: PLC0415

    spec = RunSpec(target=TARGET, run_dir=str(tmp_path), argv=["--steps", "5"], threads_per_rank=1)
    sup = launch_supervisor(spec)
    try:
        ray.get(sup.start.remote())
        summary = finished(sup, 100)
        assert summary["status"] == "completed"
        ray.kill(sup, no_restart=False)
        again = ray.get(sup.wait.remote(30.0), timeout=90)
        assert again is not None
        assert again["run_id"] == summary["run_id"] and again["status"] == "completed"
        assert again["supervisor_restarts"] == 0  # the restart came after the run's end
    finally:
        ray.kill(sup, no_restart=True)


def _ended_journal(spec: RunSpec, rank: dict[str, Any], older: bool) -> list[dict[str, Any]]:
    """journal.wal of a 1-rank run whose rank has ended: a state record with `ranks_ended`
    (state schema 8), or, `older`, the history records a journal held before it."""
    running = {"phase": "running", "generation": 0, "lost": [], "reason": "", "attempts": 0}
    if older:
        return [
            {"type": "supervisor_started", "incarnation": 1},
            {"type": "job_state", "input": "Started", "to": running},
            {"type": "ranks_ended", "results": {"0": rank}},
        ]
    from remedy.control.decide import Controller  # noqa: PLC0415
    from remedy.control.job import JobState  # noqa: PLC0415
    from remedy.control.record import RunState  # noqa: PLC0415
    from remedy.control.slots import RankSlots  # noqa: PLC0415
    from remedy.policies import Engine  # noqa: PLC0415
    from remedy.supervisor.policy_source import load_policy_source  # noqa: PLC0415

    engine = Engine(load_policy_source(spec.policy), run_id=spec.run_id)
    state = RunState(
        incarnation=1, started=time.time() - 5, job=JobState.from_dict(running),
        slots=RankSlots(1).state_records(), last_seq=RankSlots(1).seqs(), group=None,
        controller=Controller(engine, world_size=1).state_dict(), ranks_ended={"0": rank},
    )  # fmt: skip
    return [state.to_record()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("older", [False, True], ids=["state-record", "schema-7-history"])
def test_restart_after_every_rank_ended_finishes_from_the_journal(
    ray_cluster: None, tmp_path: Path, older: bool
) -> None:
    """Died after the ranks ended, before the summary: the next supervisor writes it from journal.wal
    alone, from its state record, or from the history records of a journal of schema 7."""
    from remedy.supervisor.actor import launch_supervisor  # noqa: PLC0415

    spec = RunSpec(target=TARGET, run_dir=str(tmp_path), threads_per_rank=1)
    rank = {"rank": 0, "incarnation": 1, "status": "completed", "steps_completed": 5,
            "steps_executed": 5, "final_loss": 0.25}  # fmt: skip
    records = _ended_journal(spec, rank, older)
    (tmp_path / "journal.wal").write_text("".join(json.dumps(r) + "\n" for r in records))
    sup = launch_supervisor(spec)
    try:
        summary = finished(sup, 100)
    finally:
        ray.kill(sup, no_restart=True)
    assert summary["status"] == "completed" and summary["supervisor_restarts"] == 1
    assert summary["ranks"] == [rank] and summary["final_loss"] == 0.25
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    assert [r["type"] for r in read_jsonl(tmp_path / "history.jsonl")][-1] == "run_ended"
    # The end is in the last state record: a supervisor restarted now would not run it again.
    state, _ = fold(read_jsonl(tmp_path / "journal.wal"))
    assert state is not None and state["ended"] == "completed" and state["incarnation"] == 2


def _stop_supervisor_at(run_id: str, run_dir: Path, step: int, stopped: list[int]) -> None:
    """SIGSTOP the run's supervisor, for good, once it has ingested a report of `step`."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            lines = []
        if any(json.loads(line).get("step", 0) >= step for line in lines[-20:] if line.strip()):
            sup = ray.get_actor(supervisor_name(run_id), namespace=NAMESPACE)
            pid = ray.get(sup.where.remote(), timeout=30)[1]
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            return
        time.sleep(0.05)


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_stopped_supervisor_is_killed_restarted_and_the_outage_recorded(
    two_rank_baseline: Any, tmp_path: Path
) -> None:
    """A supervisor SIGSTOPped for good at step 150 of 2 ranks: a rank or the driver finds it silent
    past the bound, kills it, Ray restarts it; every step is trained, the NaN at 200 rolled back
    once, the decisions as without the stop, and summary.json records the outage."""
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp_path), faults=[NAN], argv=ARGS,
        threads_per_rank=1, spares=0, supervisor_timeout_s=3.0,
    )  # fmt: skip
    stopped: list[int] = []
    thread = threading.Thread(
        target=_stop_supervisor_at, args=(spec.run_id, tmp_path, 150, stopped), daemon=True
    )
    thread.start()
    summary = run_supervised(spec)
    thread.join(timeout=5)
    assert stopped, "the supervisor was never stopped"
    _assert_survived(tmp_path, summary, two_rank_baseline, 2)
    (outage,) = summary["supervisor_outages"]
    assert outage["how"].startswith(f"killed its process (pid {stopped[0]}, SIGKILL) by ")
    assert outage["noticed_after_s"] >= 3.0, outage
    assert outage["duration_s"] > outage["noticed_after_s"], outage
    assert set(outage["noticed_by"]) <= {"driver", "rank 0", "rank 1"}, outage
    assert summary["supervisor_outage_s"] == outage["duration_s"]
    notes = [r for r in read_jsonl(tmp_path / "history.jsonl") if r["type"] == "supervisor_outage"]
    assert notes and all(n["note"]["ended"] is not None for n in notes)
