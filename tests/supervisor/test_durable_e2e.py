"""Durable checkpoints under a real supervisor: a corrupt checkpoint on one rank, and the full-group restart.

Real Ray actors, real gloo, real torch training (`durable_train.py`, a small
MLP under DDP), real files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray]

HERE = Path(__file__).resolve().parent
TARGET = f"{HERE / 'durable_train.py'}:main"
POLICY = str(HERE / "durable_policy.yaml")


def _run(
    tmp: Path, workers: int, steps: int, faults: list[dict[str, Any]], *args: str, **kw: Any
) -> dict[str, Any]:
    kw.setdefault("policy", POLICY)
    spec = RunSpec(
        target=TARGET, workers=workers, run_dir=str(tmp), faults=faults,
        argv=["--steps", str(steps), *args], threads_per_rank=1,
        hang_watch={"first_step_s": 10.0}, **kw,
    )  # fmt: skip
    return run_supervised(spec)


def _phases(tmp: Path) -> list[str]:
    states = [
        r["to"]["phase"] for r in read_jsonl(tmp / "history.jsonl") if r.get("type") == "job_state"
    ]
    return [p for i, p in enumerate(states) if i == 0 or states[i - 1] != p]


@pytest.mark.timeout(180)
def test_corrupt_checkpoint_on_one_rank_both_restore_the_previous_good_step(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Rank 1's checkpoint of step 50 is corrupted; a NaN's rollback reaches past the ring to disk:
    both ranks restore step 40, end bitwise equal, and the journals say why."""
    faults = [
        {"kind": "corrupt_checkpoint", "at_step": 55, "rank": 1},
        {"kind": "nan_loss", "at_step": 62, "rank": 0},
    ]
    # No rank is lost: no warm spare to start.
    summary = _run(tmp_path, 2, 100, faults, "--checkpoint-keep", "5", spares=0)
    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [100, 100]
    assert len({r["result"]["params_digest"] for r in ranks}) == 1
    decisions = read_jsonl(tmp_path / "decisions.jsonl")
    [rollback] = [d for d in decisions if d["action"] == "rollback"]
    assert rollback["outcome"] == "applied", rollback
    assert (rollback["result"]["restored_step"], rollback["result"]["source"]) == (40, "disk")
    assert "step 50 failed its checksum on rank 1" in rollback["detail"]
    assert "every rank used step 40" in rollback["detail"]
    corrupt = [
        e for e in read_jsonl(tmp_path / "anomalies.jsonl") if e["kind"] == "checkpoint_corrupt"
    ]
    assert [(e["rank"], e["details"]["checkpoint_step"]) for e in corrupt] == [(1, 50)]
    [notice] = [d for d in decisions if d["anomaly"]["kind"] == "checkpoint_corrupt"]
    assert "the checkpoint of step 50 failed its checksum" in notice["reason"]


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_replacement_that_keeps_failing_leads_to_a_full_group_restart(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Rank 2 is killed at step 25; its replacement raises; every rank restarts from checkpoint 20
    in generation 2, the run completes and every rank ends bitwise equal."""
    faults = [{"kind": "kill_rank", "at_step": 25, "rank": 2}]
    summary = _run(tmp_path, 4, 40, faults, "--fail-replacement", "gen1", max_targeted_restarts=1)
    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [40] * 4
    assert len({r["result"]["params_digest"] for r in ranks}) == 1
    assert all(r["incarnation"] >= 2 for r in ranks)
    assert {r["resumed"]["step"] for r in ranks} == {20}
    assert _phases(tmp_path) == ["running", "recovering", "restarting-all", "running", "finished"]
    [full] = [r for r in read_jsonl(tmp_path / "history.jsonl") if r.get("type") == "full_restart"]
    assert (
        full["resume_step"] == 20 and "newest of the steps every rank committed" in full["reason"]
    )
    [restart] = [
        d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["action"] == "restart_rank"
    ]
    assert restart["outcome"] == "applied", restart
    assert "from checkpoint step 20" in restart["detail"]
    record = summary["recoveries"][-1]
    assert record["reached_step"] >= 20
    assert record["steps_lost"] == record["reached_step"] - 20
    # True goodput: the survivors ran steps 0-24, then every rank redid 20-39 from the
    # checkpoint: 45 executions, 40 kept. The 5 redone and the stall are lost to rank_dead.
    assert (summary["steps_executed"], summary["steps_kept"]) == (45, 40), summary
    assert summary["goodput"] == round(40 / 45, 4)
    lost = {(r["what"], r["cause"]): r for r in summary["time_lost"]}
    discarded = lost[("discarded_steps", "rank_dead")]
    assert discarded["steps"] == 5 and discarded["seconds"] > 0, summary["time_lost"]
    stalled = lost[("stalled", "rank_dead")]["seconds"]
    assert stalled > discarded["seconds"], "detection, the failed replacement, the full restart"
    assert summary["time_lost_by_cause"]["rank_dead"] == pytest.approx(
        discarded["seconds"] + stalled, abs=0.002
    )
    # Every second of the wall time is accounted for: the kept steps' and the lost rows'.
    accounted = summary["time_kept_s"] + sum(r["seconds"] for r in summary["time_lost"])
    assert accounted == pytest.approx(summary["wall_s"], abs=0.05)
    assert 0 < summary["ettr"] < 1


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_full_restart_that_fails_too_aborts(ray_cluster: None, tmp_path: Path) -> None:
    """Every replacement raises: the targeted restart, then the full-group restart fail; the run aborts, journaled."""
    faults = [{"kind": "kill_rank", "at_step": 15, "rank": 1}]
    summary = _run(tmp_path, 4, 40, faults, "--fail-replacement", "always", max_targeted_restarts=1)
    assert summary["status"] == "aborted", summary
    assert _phases(tmp_path)[-3:] == ["restarting-all", "aborting", "aborted"]
    reasons = [
        r["reason"] for r in read_jsonl(tmp_path / "history.jsonl") if r.get("type") == "job_state"
    ]
    assert any("full-group restart failed" in r for r in reasons), reasons
    [restart] = [
        d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["action"] == "restart_rank"
    ]
    assert restart["outcome"] in ("failed", "escalated")
    assert "full-group restart failed" in restart["detail"]


# A NaN's rollback that skips the batches after it: a rank that applied it trains other
# batches than a rank that never saw it, so the parameters tell which happened.
SKIPPING_POLICY = """\
version: 1
name: rollback-at-full-restart
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 10, skip_batches: 2}
        on_failure: abort
    cooldown_steps: 20
  - name: rank-restart
    when: {anomaly: [rank_hang, rank_dead]}
    do:
      - restart_rank: {}
        on_failure: abort
"""


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_rollback_still_pending_at_a_full_restart_is_settled_by_it(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Rank 0's loss is NaN at step 32; rank 1 is SIGKILLed at the start of step 33, so rank 0
    is in step 33's broken collective when the rollback's boundary comes, and never applies
    it. No targeted restart is allowed: every rank restarts from checkpoint 30, before the
    NaN's step. The rollback is settled by that restart (journaled applied, saying so), not
    sent to the new ranks, which would rewind again and skip two good batches: the run ends
    bitwise equal to a run without either fault."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(SKIPPING_POLICY)
    faults = [
        {"kind": "nan_loss", "at_step": 32, "rank": 0},
        {"kind": "kill_rank", "at_step": 33, "rank": 1},
    ]
    run = tmp_path / "run"
    summary = _run(run, 2, 40, faults, policy=str(policy), max_targeted_restarts=0)
    assert summary["status"] == "completed", summary
    twin = _run(tmp_path / "twin", 2, 40, [], policy=str(policy))
    assert twin["status"] == "completed", twin
    digests = {r["result"]["params_digest"] for r in summary["ranks"]}
    assert digests == {r["result"]["params_digest"] for r in twin["ranks"]}, (digests, twin)
    assert [r["incarnation"] for r in summary["ranks"]] == [2, 2]
    assert {r["resumed"]["step"] for r in summary["ranks"]} == {30}
    decisions = read_jsonl(run / "decisions.jsonl")
    [rollback] = [d for d in decisions if d["action"] == "rollback"]
    assert rollback["outcome"] == "applied", rollback
    assert rollback["detail"].startswith("carried out by the full-group restart"), rollback
    assert "result" not in rollback or not rollback["result"], rollback  # no rank rewound
    [restart] = [d for d in decisions if d["action"] == "restart_rank"]
    assert restart["outcome"] == "applied", restart
    # The NaN's step ran twice, the rest once each, and no step was rewound by a rollback:
    # 0-32 before the restart (33 killed there), 30-39 after it.
    assert summary["steps_executed"] == 33 + 10, summary


@pytest.fixture(scope="module")
def loader_twin(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameters' digest of 2 ranks, 40 steps, from plain DataLoaders, without faults."""
    twin = _run(tmp_path_factory.mktemp("twin"), 2, 40, [], "--loader", spares=0)  # no loss
    assert twin["status"] == "completed", twin
    [digest] = {r["result"]["params_digest"] for r in twin["ranks"]}
    return digest


@pytest.mark.timeout(240)
def test_a_plain_dataloader_survives_a_targeted_restart_bitwise(
    loader_twin: str, tmp_path: Path
) -> None:
    """Rank 1 is SIGKILLed at step 33 of a DataLoader run. The survivor gives the failed
    step's batch back to its loader's stream; the replacement, a new process, reads its
    loader up to the adopted position before training. Both ranks end bitwise equal to the
    run without the kill. (The survivor used to drop that batch, run out of data a step
    before the replacement and end, leaving it to wait 120 s for an order: the run failed.)"""
    faults = [{"kind": "kill_rank", "at_step": 33, "rank": 1}]
    summary = _run(tmp_path, 2, 40, faults, "--loader")
    assert summary["status"] == "completed", summary
    assert [r["incarnation"] for r in summary["ranks"]] == [1, 2]
    assert {r["result"]["params_digest"] for r in summary["ranks"]} == {loader_twin}


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_plain_dataloader_resumes_a_full_restart_bitwise(
    loader_twin: str, tmp_path: Path
) -> None:
    """No targeted restart: every rank restarts from checkpoint 30 in a new process, whose
    DataLoader starts at its first batch. Each reads up to batch 30 first and ends bitwise
    equal to the run without the kill (without that it trained batches 0-9 as steps 30-39)."""
    faults = [{"kind": "kill_rank", "at_step": 33, "rank": 1}]
    summary = _run(tmp_path, 2, 40, faults, "--loader", max_targeted_restarts=0)
    assert summary["status"] == "completed", summary
    assert {r["resumed"]["step"] for r in summary["ranks"]} == {30}
    assert {r["result"]["params_digest"] for r in summary["ranks"]} == {loader_twin}
    # Rank 0 was in step 33's broken collective: its ping said 33 steps executed, the last
    # of them maybe never reported before it was killed; they count all the same.
    [restart] = [
        r for r in read_jsonl(tmp_path / "history.jsonl") if r.get("type") == "full_restart"
    ]
    assert restart["lead_executed"] == 33, restart
    assert summary["steps_executed"] == 33 + 10, summary
