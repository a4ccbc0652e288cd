"""The policy's abort takes the job to `aborting`, then `aborted`, and says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
ARGS = ["--steps", "40", "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0"]  # fmt: skip
ABORT_ON_NAN = """\
version: 1
name: abort-on-nan
rules:
  - name: give-up
    when: {anomaly: nonfinite_loss}
    do:
      - abort: {reason: a NaN loss ends this run}
"""


@pytest.mark.timeout(180)
def test_the_policys_abort_moves_the_job_to_aborting_then_aborted(
    ray_cluster: None, tmp_path: Path
) -> None:
    policy = tmp_path / "abort.yaml"
    policy.write_text(ABORT_ON_NAN)
    spec = RunSpec(
        target=TARGET, workers=2, run_dir=str(tmp_path / "run"), argv=ARGS, policy=str(policy),
        threads_per_rank=1, faults=[{"kind": "nan_loss", "at_step": 8, "rank": 1}],
        spares=0,  # no rank is lost: no warm spare to start
    )  # fmt: skip
    summary = run_supervised(spec)
    assert summary["status"] == "aborted", summary
    job = [
        r for r in read_jsonl(tmp_path / "run" / "history.jsonl") if r.get("type") == "job_state"
    ]
    assert [r["to"]["phase"] for r in job] == ["running", "aborting", "aborted"], job
    assert job[1]["reason"] == "aborting: the policy's abort: a NaN loss ends this run", job[1]
    assert summary["job"]["phase"] == "aborted"
