"""A hung or dead rank of a 4-rank gloo job is found and replaced alone; the run ends as if nothing happened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
STEPS = 40
ARGS = ["--steps", str(STEPS), "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip
# Short first-step allowance: the hang before the first step is found in seconds, not 20.
WATCH = {"first_step_s": 4.0}


def _run(tmp: Path, faults: list[dict[str, Any]], spares: int = 2, **kw: Any) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=4, run_dir=str(tmp), faults=faults, argv=ARGS,
        threads_per_rank=1, hang_watch=WATCH, spares=spares, **kw,
    )  # fmt: skip
    return run_supervised(spec)


@pytest.fixture(scope="module")
def clean_digest(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameters' digest of the same run without faults."""
    # Spares neither train nor change the weights: the clean run starts none.
    summary = _run(tmp_path_factory.mktemp("clean"), [], spares=0)
    assert summary["status"] == "completed"
    # No false alarm: pings of healthy ranks quiet between reports name nobody.
    assert summary["recoveries"] == [], summary["recoveries"]
    assert not {"rank_hang", "rank_dead"} & set(summary["anomalies"]), summary["anomalies"]
    digests = {r["result"]["params_digest"] for r in summary["ranks"]}
    assert len(digests) == 1
    return digests.pop()


def _assert_recovered(
    summary: dict[str, Any], tmp: Path, digest: str, kind: str, rank: int
) -> None:
    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [STEPS] * 4
    # No step lost: every rank executed exactly the steps it completed.
    assert [r["steps_executed"] for r in ranks] == [STEPS] * 4
    assert {r["result"]["params_digest"] for r in ranks} == {digest}
    assert ranks[rank]["incarnation"] >= 2
    decisions = read_jsonl(tmp / "decisions.jsonl")
    restart = [d for d in decisions if d["action"] == "restart_rank"]
    assert restart and restart[0]["outcome"] == "applied", decisions
    assert restart[0]["anomaly"]["kind"] == kind
    assert restart[0]["ranks"] == [rank]
    # Only the lost rank is replaced: no survivor stayed blocked on another survivor.
    [record] = summary["recoveries"]
    assert (record["ranks"], record["blocked"]) == ([rank], [])
    states = [
        r["to"]["phase"] for r in read_jsonl(tmp / "history.jsonl") if r.get("type") == "job_state"
    ]
    # Consecutive records of one phase: a survivor still blocked joins the same recovery.
    phases = [p for i, p in enumerate(states) if i == 0 or states[i - 1] != p]
    assert phases[:3] == ["running", "recovering", "running"]
    assert states[-1] == "finished"


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_hung_rank_is_replaced_and_the_run_matches_a_clean_one(
    clean_digest: str, tmp_path: Path
) -> None:
    """hang_rank on rank 3 at step 20 -> rank_hang -> restart_rank applied; parameters equal a clean run's."""
    summary = _run(tmp_path, [{"kind": "hang_rank", "at_step": 20, "rank": 3}])
    _assert_recovered(summary, tmp_path, clean_digest, "rank_hang", 3)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_killed_rank_is_replaced(clean_digest: str, tmp_path: Path) -> None:
    """kill_rank on rank 2 at step 15 -> rank_dead -> restart_rank applied; parameters equal a clean run's.

    Slow tier (two 4-rank runs): the default tier replaces a killed rank of 2 and ends bitwise
    equal to a clean run in test_nanogpt_shaped_e2e and test_durable_e2e (DataLoader), and
    replaces blocked survivors with the lost rank in core/test_restart.py."""
    summary = _run(tmp_path, [{"kind": "kill_rank", "at_step": 15, "rank": 2}])
    _assert_recovered(summary, tmp_path, clean_digest, "rank_dead", 2)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_rank_zero_can_be_replaced(clean_digest: str, tmp_path: Path) -> None:
    """Rank 0 hangs: the supervisor's store outlives it, rank 1's state is adopted, the run matches."""
    summary = _run(tmp_path, [{"kind": "hang_rank", "at_step": 10, "rank": 0}])
    _assert_recovered(summary, tmp_path, clean_digest, "rank_hang", 0)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_hang_before_the_first_step(clean_digest: str, tmp_path: Path) -> None:
    """A rank that hangs before its first step is found after the first-step allowance and replaced."""
    summary = _run(tmp_path, [{"kind": "hang_rank", "at_step": 0, "rank": 2}])
    _assert_recovered(summary, tmp_path, clean_digest, "rank_hang", 2)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_faults_in_a_row(clean_digest: str, tmp_path: Path) -> None:
    """A hang of rank 3, then a kill of rank 1: two targeted restarts, and the run still matches."""
    faults = [
        {"kind": "hang_rank", "at_step": 8, "rank": 3},
        {"kind": "kill_rank", "at_step": 28, "rank": 1},
    ]
    summary = _run(tmp_path, faults)
    assert summary["status"] == "completed", summary
    assert {r["result"]["params_digest"] for r in summary["ranks"]} == {clean_digest}
    assert [r["steps_executed"] for r in summary["ranks"]] == [STEPS] * 4
    restarts = [
        d
        for d in read_jsonl(tmp_path / "decisions.jsonl")
        if d["action"] == "restart_rank" and d["outcome"] == "applied"
    ]
    assert [d["anomaly"]["kind"] for d in restarts] == ["rank_hang", "rank_dead"]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_hang_while_a_rollback_is_in_flight(ray_cluster: None, tmp_path: Path) -> None:
    """A NaN's rollback is pending when rank 2 hangs: both are applied and the replicas end identical."""
    faults = [
        {"kind": "nan_loss", "at_step": 12, "rank": 0},
        {"kind": "hang_rank", "at_step": 13, "rank": 2},
    ]
    summary = _run(tmp_path, faults)
    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [STEPS] * 4
    assert len({r["result"]["params_digest"] for r in ranks}) == 1
    assert len({r["steps_executed"] for r in ranks}) == 1
    outcomes = {}
    for d in read_jsonl(tmp_path / "decisions.jsonl"):
        outcomes.setdefault(d["action"], d["outcome"])
    assert outcomes["rollback"] == "applied"
    assert outcomes["restart_rank"] == "applied"


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_slow_rank_is_not_named_hung(clean_digest: str, tmp_path: Path) -> None:
    """Rank 1 is 3 s late in its collectives: every rank stalls past its timeout, all answer, none is replaced."""
    faults = [{"kind": "slow_collective", "at_step": 15, "rank": 1, "seconds": 3.0}]
    summary = _run(tmp_path, faults)
    assert summary["status"] == "completed", summary
    assert summary["recoveries"] == []
    assert "rank_hang" not in summary["anomalies"]
    assert {r["result"]["params_digest"] for r in summary["ranks"]} == {clean_digest}
    assert [r["incarnation"] for r in summary["ranks"]] == [1] * 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replacement_that_dies_as_it_joins_is_launched_again(
    clean_digest: str, tmp_path: Path
) -> None:
    """kill_rank on rank 2 at step 15, `duration: 2`: its first replacement dies after the new
    generation formed, while the survivors adopt the state in it. The next attempt forms the
    generation after it over a new store; the survivors live through both, no full-group
    restart runs, and the parameters equal a clean run's."""
    summary = _run(tmp_path, [{"kind": "kill_rank", "at_step": 15, "rank": 2, "duration": 2}])
    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [STEPS] * 4
    assert [r["steps_executed"] for r in ranks] == [STEPS] * 4
    assert {r["result"]["params_digest"] for r in ranks} == {clean_digest}
    # The survivors are the processes that started the run; rank 2 is its third process.
    assert [r["incarnation"] for r in ranks] == [1, 1, 3, 1], ranks
    restart = [d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["action"] == "restart_rank"]
    assert [(d["outcome"], d["ranks"]) for d in restart] == [("applied", [2])], restart
    states = [r for r in read_jsonl(tmp_path / "history.jsonl") if r.get("type") == "job_state"]
    assert [(r["input"], r["to"]["phase"]) for r in states] == [
        ("Started", "running"),
        ("RanksLost", "recovering"),
        ("RestartFailed", "recovering"),  # the first replacement died: one failed attempt
        ("Regrouped", "running"),
        ("RanksEnded", "finished"),
    ], states
    # The failed attempt formed generation 1; the next one formed generation 2.
    assert states[3]["to"]["generation"] == 2
    [record] = summary["recoveries"]
    assert (record["generation"], record["replacements"]) == (2, {"2": "new actor"})
