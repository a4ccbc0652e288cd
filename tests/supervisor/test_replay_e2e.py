"""Real ranks under the supervisor and llm-pretrain: a chip's fault is replaced, the data's rolled back.

The example GPT trains 60 steps on gloo ranks (Ray actors, a warm spare each
run); chaos corrupts one rank at step 25. The policy replays the anomalous
step, classifies it, and acts on the answer: `restart_rank` of the faulty
rank (no rollback) for a flipped bit or a bad chip, a rollback that skips the
batches for a poisoned batch. A flipped weight bit that raises nothing is
found by the replica check (every 50 steps) and its rank replaced.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
STEPS = 60
S = 25
ARGS = ["--steps", str(STEPS), "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip
NUMERICS = {"nonfinite_loss", "nonfinite_grad", "loss_spike", "grad_norm_explosion"}


def _run(
    tmp: Path, faults: list[dict[str, Any]], workers: int = 2, spares: int = 1
) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=workers, run_dir=str(tmp), faults=faults, argv=ARGS,
        policy="llm-pretrain", threads_per_rank=1, spares=spares,
    )  # fmt: skip
    return run_supervised(spec)


def _completed_equal(summary: dict[str, Any], workers: int = 2) -> str:
    """The run completed every step on every rank, whose weights are bitwise equal; their digest."""
    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["steps_completed"] for r in ranks] == [STEPS] * workers
    digests = {r["result"]["params_digest"] for r in ranks}
    assert len(digests) == 1, "the replicas ended with different weights"
    return digests.pop()


def _epoch(iso: str) -> float:
    """A journal line's time stamp (ISO 8601, UTC) as seconds since the epoch."""
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _decisions(tmp: Path) -> list[dict[str, Any]]:
    return read_jsonl(tmp / "decisions.jsonl")


def _replay_and_answer(tmp: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The applied replay_step, and the decisions taken on its classification."""
    decisions = _decisions(tmp)
    replays = [d for d in decisions if d["action"] == "replay_step" and d["outcome"] == "applied"]
    assert replays, [(d["action"], d["outcome"], d["detail"]) for d in decisions]
    replay = replays[0]
    # The ranks held at the flagged step's boundary for the decision (workers.flag_hold):
    # the replay ran there, with no step trained past the anomalous one.
    assert replay["applied_at_step"] == replay["anomaly"]["step"] + 1, replay
    answer = [
        d
        for d in decisions
        if (d["anomaly"].get("details") or {}).get("replay_decision") == replay["decision_id"]
    ]
    return replay, answer


@pytest.fixture(scope="module")
def clean_digest(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The weights of the same run without faults."""
    summary = _run(tmp_path_factory.mktemp("clean"), [])
    assert not set(summary["anomalies"]) & NUMERICS, summary["anomalies"]
    return _completed_equal(summary)


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_a_flipped_gradient_bit_replaces_the_rank_without_a_rollback(
    clean_digest: str, tmp_path: Path
) -> None:
    """bitflip in rank 1's gradient at step 25 -> transient on rank 1 -> restart_rank [1], notify;
    no rollback; the weights end as a run without the fault."""
    summary = _run(tmp_path, [{"kind": "bitflip", "at_step": S, "rank": 1, "target": "grad"}])
    assert _completed_equal(summary) == clean_digest
    replay, answer = _replay_and_answer(tmp_path)
    verdict = replay["result"]["verdict"]
    assert (verdict["kind"], verdict["rank"], verdict["step"]) == ("replay_transient", 1, S)
    assert sorted((d["action"], d["outcome"], d["ranks"]) for d in answer) == [
        ("notify", "applied", [1]),
        ("restart_rank", "applied", [1]),
    ]
    assert all(d["anomaly"]["details"]["node"] for d in answer), "the node to cordon"
    assert not [d for d in _decisions(tmp_path) if d["action"] == "rollback"]
    assert summary["ranks"][1]["incarnation"] == 2


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_a_bad_chip_is_replaced_and_the_fault_does_not_come_back(
    ray_cluster: None, tmp_path: Path
) -> None:
    """bad_rank on rank 1 from step 25 -> rank-specific -> restart_rank [1]; nothing after it."""
    summary = _run(tmp_path, [{"kind": "bad_rank", "at_step": S, "rank": 1, "target": "grad"}])
    _completed_equal(summary)
    replay, answer = _replay_and_answer(tmp_path)
    verdict = replay["result"]["verdict"]
    assert (verdict["kind"], verdict["rank"]) == ("replay_rank_specific", 1), verdict["reason"]
    (restart,) = [d for d in answer if d["action"] == "restart_rank"]
    assert (restart["outcome"], restart["ranks"]) == ("applied", [1])
    # No anomaly once the group stepped again with the replacement, and no other remedy.
    stepped = restart["result"]["stepped_at"]
    later = [a for a in read_jsonl(tmp_path / "anomalies.jsonl") if _epoch(a["ts"]) > stepped]
    assert not [a for a in later if a["kind"] in NUMERICS], later
    actions = {d["action"] for d in _decisions(tmp_path) if d["outcome"] == "applied"}
    assert actions == {"replay_step", "restart_rank", "notify"}


@pytest.mark.timeout(420)
def test_a_poisoned_batch_is_reproducible_and_rolled_back(
    ray_cluster: None, tmp_path: Path
) -> None:
    """A loss spike from a poisoned batch on rank 0 -> reproducible -> rollback and skip, no restart."""
    fault = {"kind": "loss_spike", "at_step": S, "rank": 0, "factor": 20.0}
    # No warm spare: a replacement (there must be none) would be a cold start, a new incarnation.
    summary = _run(tmp_path, [fault], spares=0)
    _completed_equal(summary)
    replay, answer = _replay_and_answer(tmp_path)
    assert replay["anomaly"]["kind"] == "loss_spike"
    assert replay["result"]["verdict"]["kind"] == "replay_reproducible"
    (rollback,) = answer
    assert (rollback["action"], rollback["outcome"]) == ("rollback", "applied")
    assert rollback["params"] == {"steps_back": 100, "skip_batches": 300}
    assert rollback["result"]["skipped_count"] == 300
    assert [r["incarnation"] for r in summary["ranks"]] == [1, 1], "no rank was replaced"


@pytest.mark.timeout(480)
@pytest.mark.slow
def test_a_silently_flipped_weight_is_found_by_the_replica_check(
    ray_cluster: None, tmp_path: Path
) -> None:
    """A low mantissa bit of a weight on rank 1 of 3 at step 20 raises nothing; the check at step
    50 names rank 1 against the other two, and the policy replaces it."""
    fault = {"kind": "bitflip", "at_step": 20, "rank": 1, "target": "param", "bit": 3}
    summary = _run(tmp_path, [fault], workers=3)
    _completed_equal(summary, workers=3)
    assert not set(summary["anomalies"]) & NUMERICS, "the flipped bit raised nothing else"
    (found,) = [
        a for a in read_jsonl(tmp_path / "anomalies.jsonl") if a["kind"] == "replica_divergence"
    ]
    assert (found["rank"], found["step"]) == (1, 50)
    details = found["details"]
    assert details["odd"] == [1] and details["group"] == [0, 1, 2]
    assert details["first_difference"] == "tok_emb.weight"
    assert details["last_agreed_step"] is None or details["last_agreed_step"] < 20
    restart = next(d for d in _decisions(tmp_path) if d["action"] == "restart_rank")
    assert (restart["outcome"], restart["ranks"], restart["rule"]) == (
        "applied",
        [1],
        "bad-chip-restart",
    )
