"""A lost rank nothing replaces (a notify-only policy, a dry run) takes the job out of `running`, and says why."""

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
ARGS = ["--steps", "40", "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip
KILL = {"kind": "kill_rank", "at_step": 10, "rank": 1}
NOTIFY_ONLY = """\
version: 1
name: notify-only
rules:
  - name: tell-a-person
    when: {anomaly: [rank_hang, rank_dead]}
    do: [notify]
"""


def _run(tmp: Path, **kw: Any) -> dict[str, Any]:
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp / "run"), faults=[KILL], argv=ARGS,
        threads_per_rank=1, spares=0, **kw,
    )  # fmt: skip
    return run_supervised(spec)


def _assert_degraded_then_failed(run: Path, summary: dict[str, Any], answer: str) -> None:
    assert summary["status"] == "failed", summary
    job = [r for r in read_jsonl(run / "history.jsonl") if r.get("type") == "job_state"]
    assert [r["to"]["phase"] for r in job] == ["running", "degraded", "failed"], job
    said = job[1]["reason"]
    assert "rank 1" in said and "not replaced" in said and answer in said, said
    # The summary ends the job for that reason, not for "every rank ended".
    assert summary["job"]["phase"] == "failed"
    assert "not replaced" in summary["job"]["reason"], summary["job"]


@pytest.mark.timeout(180)
def test_dead_rank_under_a_notify_only_policy(ray_cluster: None, tmp_path: Path) -> None:
    """kill_rank on rank 1 -> rank_dead -> notify: the job degrades and the run ends failed, saying why."""
    policy = tmp_path / "notify-only.yaml"
    policy.write_text(NOTIFY_ONLY)
    summary = _run(tmp_path, policy=str(policy))
    _assert_degraded_then_failed(tmp_path / "run", summary, "chose notify (applied)")


@pytest.mark.timeout(180)
def test_dead_rank_in_a_dry_run(ray_cluster: None, tmp_path: Path) -> None:
    """Under --dry-run the restart is journaled dry_run, nothing replaces the rank, the job degrades."""
    summary = _run(tmp_path, dry_run=True)
    _assert_degraded_then_failed(tmp_path / "run", summary, "chose restart_rank (dry_run)")
