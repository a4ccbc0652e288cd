"""Rank 0's own eval and save under `remedy run --workers 2`: no false alarm, and a real hang meanwhile
is still found (`rank.loop.phases`, the hang watch's `loop_phase`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import metrics_paths, read_jsonl
from tests.paths import PYTHONPATH

pytestmark = [pytest.mark.ray]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TRAIN = HERE / "phases_train.py"
TARGET = f"{TRAIN}:main"
EVAL_S = 3.0


# A rank behind its peers is named hung after `behind_s` (10 s by default): shorter than rank
# 0's eval here, so that an eval which held rank 0 a step behind would name it, were phases
# not accounted for.
WATCH = {"behind_s": 2.0}


def _run(
    tmp: Path, argv: list[str], faults: list[dict[str, Any]] | None = None, spares: int = 1
) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp), argv=argv, faults=faults or [],
        threads_per_rank=1, spares=spares, hang_watch=WATCH,
    )  # fmt: skip
    return run_supervised(spec)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [m for p in metrics_paths(run_dir) for m in read_jsonl(p)]


def _waited_for_rank_0(run_dir: Path, steps: list[int], at_least_s: float) -> None:
    """Rank 1 waited for rank 0's phase before each of `steps` (the phase really happened)."""
    waits = {m["step"]: m.get("phase_wait_s", 0.0) for m in _metrics(run_dir) if m["rank"] == 1}
    assert all(waits[s] >= at_least_s for s in steps), {s: waits.get(s) for s in steps}


@pytest.mark.timeout(300)
def test_rank_0s_eval_and_save_raise_nothing(ray_cluster: None, tmp_path: Path) -> None:
    """60 steps; rank 0 evaluates for 3 s after steps 25 and 50 (a step behind rank 1, for
    longer than the hang watch's behind_s) and saves a checkpoint taking 10x a step before
    steps 20 and 40, while rank 1 waits in its all-reduce: 0 anomalies, 0 decisions."""
    argv = ["--steps", "60", "--eval-every", "25", "--eval-after", "--eval-s", str(EVAL_S),
            "--save-every", "20"]  # fmt: skip
    # No warm spare to start: a rank named hung would be an anomaly and a decision here, which
    # fail the test whether or not a spare replaces it.
    summary = _run(tmp_path, argv, spares=0)
    assert summary["status"] == "completed", summary
    assert read_jsonl(tmp_path / "anomalies.jsonl") == []
    assert read_jsonl(tmp_path / "decisions.jsonl") == []
    # Rank 0 was never replaced: its own process made both evals and both saves.
    assert [r["result"]["evals"] for r in summary["ranks"]] == [2, 0]
    assert [r["result"]["saves"] for r in summary["ranks"]] == [2, 0]
    _waited_for_rank_0(tmp_path, [26, 51], EVAL_S * 0.8)


@pytest.mark.slow  # 45 s on a quiet machine (the replacement's start and adoption)
@pytest.mark.timeout(300)
def test_a_hang_during_rank_0s_eval_is_still_found(ray_cluster: None, tmp_path: Path) -> None:
    """hang_rank stops rank 1 at step 30, as rank 0 starts its 3 s eval: rank 1 is found hung
    (silent, whatever phase its peer is in), replaced, and the run completes; nothing else is
    raised (rank 0, in its phase, is neither hung nor slow)."""
    argv = ["--steps", "50", "--eval-every", "30", "--eval-s", str(EVAL_S)]
    summary = _run(tmp_path, argv, [{"kind": "hang_rank", "at_step": 30, "rank": 1}])
    assert summary["status"] == "completed", summary
    anomalies = read_jsonl(tmp_path / "anomalies.jsonl")
    assert [(a["kind"], a["rank"]) for a in anomalies] == [("rank_hang", 1)], anomalies
    restarts = [
        d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["action"] == "restart_rank"
    ]
    assert [(d["ranks"], d["outcome"]) for d in restarts] == [([1], "applied")]
    assert [r["steps_completed"] for r in summary["ranks"]] == [50, 50]


# ----------------------------------------------------------------- long variants
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "argv",
    [
        ["--eval-every", "50", "--eval-s", str(EVAL_S)],
        ["--save-every", "50", "--save-factor", "10"],
        ["--eval-every", "50", "--eval-s", str(EVAL_S), "--declare", "--eval-after"],
    ],
    ids=["eval", "save", "declared-eval-after"],
)
def test_300_steps_with_rank_0s_eval_or_save_raise_nothing(
    ray_cluster: None, tmp_path: Path, argv: list[str]
) -> None:
    """300 steps, rank 0 evaluating 3 s (or saving 10x a step) every 50: 0 anomalies."""
    summary = _run(tmp_path, ["--steps", "300", *argv])
    assert summary["status"] == "completed", summary
    assert read_jsonl(tmp_path / "anomalies.jsonl") == []
    assert read_jsonl(tmp_path / "decisions.jsonl") == []
    if "--eval-s" in argv:
        after = int("--eval-after" in argv)
        _waited_for_rank_0(tmp_path, [s + after for s in range(50, 300, 50)], EVAL_S * 0.8)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_300_steps_under_torchrun_raise_nothing(tmp_path: Path) -> None:
    """The same loop under real torchrun (the group decides, no supervisor): rank 0 evaluates
    3 s and saves 10x a step every 50 of 300 steps: 0 anomalies."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(TRAIN), "--run-dir", str(run_dir), "--steps", "300", "--eval-every", "50",
            "--eval-s", str(EVAL_S), "--save-every", "50"]  # fmt: skip
    proc = subprocess.run(
        argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=560, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert read_jsonl(run_dir / "anomalies.jsonl") == []
    _waited_for_rank_0(run_dir, [50, 100, 150, 200, 250], EVAL_S * 0.8)


@pytest.mark.slow  # ~90 s: the replacement waits for the survivor's 20 s eval
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dies", [0, 1])
def test_a_rank_lost_while_every_rank_evaluates_is_replaced_without_a_full_restart(
    ray_cluster: None, tmp_path: Path, dies: int
) -> None:
    """Every rank evaluates for 20 s before step 30 (no collective in flight: each step's
    agreement was settled) and one rank's process dies 10 s in: the survivor is in its own
    code, not in the broken collective, so the targeted restart waits for it to meet the
    error at its next step (10 s on, longer than the survivors' grace and their silent
    allowance together) and re-forms the group; no full restart."""
    argv = ["--steps", "50", "--eval-every", "30", "--eval-s", "20", "--eval-ranks", "all",
            "--die-in-eval", str(dies), "--die-marker", str(tmp_path / "died")]  # fmt: skip
    summary = _run(tmp_path / "run", argv)
    assert summary["status"] == "completed", summary
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    assert [(d["action"], d["ranks"], d["outcome"]) for d in decisions] == [
        ("restart_rank", [dies], "applied")
    ], decisions
    # Targeted: the survivor's process trained throughout (a full restart, which resolves
    # the decision `applied` too, would have replaced it as well).
    assert {r["rank"]: r["incarnation"] for r in summary["ranks"]} == {dies: 2, 1 - dies: 1}
    assert [r["steps_completed"] for r in summary["ranks"]] == [50, 50]


@pytest.mark.slow  # ~5 min: the group resumes into a 130 s eval, past the restart's 120 s
@pytest.mark.timeout(600)
def test_a_group_that_resumes_into_a_long_eval_is_waited_on_past_the_restart_deadline(
    ray_cluster: None, tmp_path: Path
) -> None:
    """A full-group restart (targeted restarts off) resumes both ranks from the checkpoint of
    step 30, and every rank evaluates at the step it resumed from for 130 s: longer than the
    restart's 120 s for the group to step (`REGROUP_TIMEOUT_S`). Each answers from the phase
    between steps, within its bound (300 s), so the restart waits on and the run completes
    instead of aborting."""
    argv = ["--steps", "45", "--checkpoint-every", "30", "--eval-every", "30", "--eval-s",
            "130", "--eval-ranks", "all", "--eval-on-resume"]  # fmt: skip
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp_path), argv=argv, threads_per_rank=1,
        spares=0, max_targeted_restarts=0, faults=[{"kind": "kill_rank", "at_step": 40, "rank": 1}],
    )  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    decisions = read_jsonl(tmp_path / "decisions.jsonl")
    assert [(d["action"], d["outcome"]) for d in decisions] == [("restart_rank", "applied")], (
        decisions
    )
    assert [r["result"]["evals"] for r in summary["ranks"]] == [1, 1]
    assert [r["steps_completed"] for r in summary["ranks"]] == [45, 45]
