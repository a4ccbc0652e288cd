"""A live supervisor fed malformed report batches through Ray stays up, counts them, and its run completes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray

from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl
from remedy.supervisor.actor import SupervisorActor
from tests.supervisor.runs import finished

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
POLICY = """
version: 1
name: nan-only
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 10, skip_batches: 2}
"""
NAN_AT = 80


def nan(rank: int, step: int, **fields: Any) -> dict[str, Any]:
    ev = {"kind": "nonfinite_loss", "rank": rank, "step": step, "severity": "critical"}
    return {**ev, **fields}


def hostile(step: int, token: str) -> list[tuple[Any, dict[str, int]]]:
    """(batch, the rejections it must add) for a 1-rank run whose rank 0 is near `step`.

    Batches carry the run's `token` unless the case is about the token.
    """
    ok = {"rank": 0, "step": step, "token": token}  # a plausible header: the items are wrong
    good = {**ok, "tick": step, "events": [nan(0, step)]}  # would roll back, with the token
    return [
        # Another run's token, none, or not a string: refused before anything is read.
        ({**good, "token": "f" * 32}, {"token": 1}),
        ({k: v for k, v in good.items() if k != "token"}, {"token": 1}),
        ({**good, "token": ["x"]}, {"token": 1}),
        ({**good, "token": token[:-1]}, {"token": 1}),
        ("not a batch", {"token": 1}),
        ({"token": token, "rank": "0"}, {"batch_bad_rank": 1}),
        (
            {"token": token, "rank": 7, "step": step, "tick": 10**12, "events": [nan(7, step)]},
            {"batch_rank_outside_world": 1},
        ),
        (
            {"token": token, "rank": 0, "step": step, "tick": 10**12, "events": [nan(0, step)]},
            {"batch_tick_too_far_ahead": 1},
        ),
        ({"token": token, "rank": 0, "step": step, "tick": "abc"}, {"batch_bad_tick": 1}),
        ({"token": token, "rank": 0, "step": step, "tick": None}, {"batch_bad_tick": 1}),
        ({"token": token, "rank": 0, "step": step, "tick": [1]}, {"batch_bad_tick": 1}),
        ({"token": token, "rank": 0, "step": 10**30}, {"batch_bad_step": 1}),
        ({**ok, "events": [nan(0, 10**30)]}, {"event_step_out_of_range": 1}),
        ({**ok, "events": [nan(0, step, value=10**400)]}, {"event_invalid": 1}),
        ({**ok, "events": "nope"}, {"events_not_list": 1}),
        ({**ok, "metrics": [{"step": step, "loss": 10**400}, "garbage"]}, {"metrics_invalid": 2}),
        (
            {
                **ok,
                "outcomes": [
                    {"decision_id": ["x"], "rank": 0, "outcome": "applied", "step": 1, "tick": 1}
                ],
            },
            {"outcome_invalid": 1},
        ),
        (
            {**ok, "events": [{"kind": "nonsense", "rank": 0, "step": step}] * 20_000},
            {"event_invalid": 1024, "events_over_batch_cap": 20_000 - 1024},
        ),
    ]


def test_live_supervisor_refuses_hostile_batches(ray_cluster: None, tmp_path: Path) -> None:
    """Hostile batches sent while a real run trains are counted by reason; the NaN rollback
    after them still applies and the run completes."""
    policy = tmp_path / "nan.yaml"
    policy.write_text(POLICY)
    argv = ["--steps", "160", "--layers", "1", "--width", "32", "--sample-every", "0"]
    spec = RunSpec(
        target=TARGET,
        policy=str(policy),
        run_dir=str(tmp_path / "run"),
        argv=argv,
        faults=[
            {"kind": "nan_loss", "at_step": NAN_AT, "rank": 0},
            # Slow steps until the NaN, so the hostile batches surely come first (>= 8 s).
            {"kind": "slow_loader", "at_step": 0, "duration": NAN_AT, "seconds": 0.1, "rank": 0},
        ],
    )
    actor = SupervisorActor.remote(spec.to_dict())  # type: ignore[attr-defined]
    actor.start.remote()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 200
    step = 0
    while step < 3 and time.monotonic() < deadline:
        step = ray.get(actor.status.remote(spec.token))["step"].get(0, 0)  # type: ignore[attr-defined]
        time.sleep(0.1)
    assert step >= 3, "the run did not start"
    expected: dict[str, int] = {}
    for batch, adds in hostile(step, spec.token):
        assert ray.get(actor.report.remote(batch)) == []  # type: ignore[attr-defined]
        for reason, n in adds.items():
            expected[reason] = expected.get(reason, 0) + n
    status = ray.get(actor.status.remote(spec.token))  # type: ignore[attr-defined]
    assert status["rejected"] == expected
    assert max(status["step"].values()) < NAN_AT, "the NaN must come after the hostile batches"
    summary = finished(actor)
    assert summary["status"] == "completed"
    assert summary["rejected"] == expected
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    assert [(d["rule"], d["action"], d["outcome"]) for d in decisions] == [
        ("nan-rollback", "rollback", "applied")
    ]
    assert decisions[0]["anomaly"]["step"] == NAN_AT
    # The rank recorded the fault as fired in the run directory (a replacement would not refire it).
    (marker,) = (tmp_path / "run" / "chaos" / "fired").glob("nan_loss-*.json")
    assert '"step": 80' in marker.read_text()
