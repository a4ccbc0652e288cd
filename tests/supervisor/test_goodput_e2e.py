"""Real runs (Ray, gloo, the tiny GPT): every second of a run's wall time is kept or booked to a
named cause: a hung rank's stall to rank_hang, a killed one's to rank_dead, a supervisor's
outage apart; no row negative, and the rows sum to the wall time."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from remedy.cli.runner import run_supervised
from remedy.control.goodput import when
from remedy.protocol.spec import RunSpec
from remedy.rank.chaos.faults import FAULT_SIGNS
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
TINY = ["--layers", "1", "--width", "32", "--batch-size", "4", "--block-size", "32",
        "--sample-every", "0"]  # fmt: skip
# Rows of the time no fault causes: the run's start and end, and the time between steps.
UNCAUSED = {"startup", "shutdown", "overhead"}


def _run(tmp: Path, workers: int, steps: int, faults: list[dict[str, Any]]) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=workers, run_dir=str(tmp), faults=faults,
        argv=["--steps", str(steps), *TINY], threads_per_rank=1, spares=2,
    )  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    return summary


def _assert_booked(summary: dict[str, Any]) -> dict[str, float]:
    """Every row non-negative and named, the rows and the kept time the wall time; returns
    the seconds by cause."""
    rows = summary["time_lost"]
    assert all(r["seconds"] >= 0 for r in rows), rows
    assert not [r for r in rows if r["what"] == "other"], rows
    for r in rows:
        if r["what"] not in UNCAUSED:
            assert r["cause"] not in (None, "unattributed"), r
    total = summary["time_kept_s"] + sum(r["seconds"] for r in rows)
    assert total == pytest.approx(summary["wall_s"], abs=0.05), (total, summary["wall_s"])
    return dict(summary["time_lost_by_cause"])


def test_a_hang_and_a_kill_are_booked_to_rank_hang_and_rank_dead(
    ray_cluster: None, tmp_path: Path
) -> None:
    """2 ranks: rank 1 hangs at step 20, its replacement is killed at step 40. Each stall
    (detection included) is booked to its anomaly, and each decision names the step."""
    faults = [{"kind": "hang_rank", "at_step": 20, "rank": 1},
              {"kind": "kill_rank", "at_step": 40, "rank": 1}]  # fmt: skip
    summary = _run(tmp_path, 2, 60, faults)
    by_cause = _assert_booked(summary)
    assert by_cause.get("rank_hang", 0) > 0 and by_cause.get("rank_dead", 0) > 0, by_cause
    restarts = [
        (d["anomaly"]["kind"], d["anomaly"]["step"], d["outcome"])
        for d in read_jsonl(tmp_path / "decisions.jsonl")
        if d["action"] == "restart_rank"
    ]
    assert restarts == [("rank_hang", 20, "applied"), ("rank_dead", 40, "applied")]


def test_a_killed_supervisor_is_booked_apart(ray_cluster: None, tmp_path: Path) -> None:
    """The supervisor is SIGKILLed at step 30 and Ray restarts it: its outage is recorded, the
    ranks trained on meanwhile, and nothing is booked to a cause that did not happen."""
    summary = _run(tmp_path, 2, 60, [{"kind": "kill_supervisor", "at_step": 30, "rank": 0}])
    by_cause = _assert_booked(summary)
    [outage] = summary["supervisor_downtime"]
    assert outage["down_s"] >= 0
    assert set(by_cause) <= {"supervisor_restart"}, by_cause


# The storm: nine faults on four ranks within 45 steps, after the detectors' warm-up. The
# straggler comes first: a rollback sends the ranks back to an earlier step, where the policy's
# warm-up (`warmup_steps` of the throughput anomalies) would hold its notification back. It
# lasts 20 steps: the straggler watch compares the median of a rank's last 20 step times.
STORM = [
    {"kind": "slow_rank", "at_step": 22, "rank": 2, "duration": 20, "seconds": 0.3},
    {"kind": "nan_loss", "at_step": 27, "rank": 0},
    {"kind": "loss_spike", "at_step": 31, "rank": 1, "factor": 10.0},
    {"kind": "oom", "at_step": 35, "rank": 2},
    {"kind": "hang_rank", "at_step": 39, "rank": 3},
    {"kind": "kill_rank", "at_step": 44, "rank": 1},
    {"kind": "nan_grad", "at_step": 54, "rank": 0},
    {"kind": "loss_spike", "at_step": 60, "rank": 3, "factor": 10.0},
    {"kind": "kill_rank", "at_step": 66, "rank": 2},
]
# A fault's marker and the anomaly it causes are stamped by clocks of one machine, the marker
# to the second on some file systems.
CLOCK_SLACK_S = 1.0


def _fired_at(run_dir: Path, fault: dict[str, Any]) -> float | None:
    """When `fault` fired (its marker in chaos/fired/); None for a fault that leaves none."""
    pattern = f"{fault['kind']}-s{fault['at_step']}-r{fault['rank']}-*.json"
    markers = sorted((run_dir / "chaos" / "fired").glob(pattern))
    return markers[0].stat().st_mtime if markers else None


@pytest.mark.timeout(900)
def test_a_storm_of_nine_faults_on_four_ranks_is_remedied_and_every_second_booked(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Every fault of the storm is detected (an anomaly it shows as, on its rank, after it fired)
    and answered by an applied decision on that anomaly; every second lost is booked to a
    named cause."""
    summary = _run(tmp_path, 4, 90, STORM)
    anomalies = read_jsonl(tmp_path / "anomalies.jsonl")
    decisions = read_jsonl(tmp_path / "decisions.jsonl")
    for fault in STORM:
        fired = _fired_at(tmp_path, fault)
        after = -math.inf if fired is None else fired - CLOCK_SLACK_S
        found = [
            a for a in anomalies
            if a["kind"] in FAULT_SIGNS[fault["kind"]] and a["rank"] == fault["rank"]
            and (when(a["ts"]) or 0.0) >= after
        ]  # fmt: skip
        seen = [(a["kind"], a["rank"], a["step"]) for a in anomalies]
        assert found, f"{fault} not detected: {seen}"
        kinds = {a["kind"] for a in found}
        answered = [
            d for d in decisions
            if d["anomaly"]["kind"] in kinds and d["anomaly"]["rank"] == fault["rank"]
            and d["outcome"] == "applied" and (when(d["ts"]) or 0.0) >= after
        ]  # fmt: skip
        assert answered, f"{fault}: {sorted(kinds)} not remedied"
    by_cause = _assert_booked(summary)
    for kind in ("rank_hang", "rank_dead", "nonfinite_loss"):
        assert by_cause.get(kind, 0) > 0, by_cause
