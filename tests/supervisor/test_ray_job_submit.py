"""`ray job submit -- remedy run ...` on a `ray start --head` cluster: the job's status is the run's.

The cluster is the test's own (see `headnode`): 127.0.0.1, its own HOME and
temp dir, token authentication throughout, stopped by its session's pids
(never `ray stop`). A completing run makes a SUCCEEDED job, a failing one a
FAILED job; both write their run directories, and `remedy status` finds both
through the registry their drivers wrote.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.supervisor.headnode import RAY, REPO, Head, head_node

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(240)]

GPT = ["examples/pretrain_gpt.py:main"]
GPT_ARGS = ["--steps", "30", "--layers", "1", "--width", "32", "--sample-every", "0"]
TINY = ["tests/robustness/targets/tiny.py:main"]


def _submit(head: Head, job_id: str, entrypoint: list[str]) -> subprocess.Popen[str]:
    argv = [RAY, "job", "submit", "--address", head.dashboard, "--submission-id", job_id]
    return subprocess.Popen(
        [*argv, "--working-dir", ".", "--", *entrypoint],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=head.env,
        cwd=REPO,
    )


def _job_status(head: Head, job_id: str) -> str:
    proc = head.run(RAY, "job", "status", "--address", head.dashboard, job_id, timeout=60)
    text = (proc.stdout + proc.stderr).lower()
    # "Job 'ID' succeeded" once it ended, "Status for job 'ID': RUNNING" before.
    for status in ("SUCCEEDED", "FAILED", "STOPPED", "RUNNING", "PENDING"):
        if f"'{job_id}' {status.lower()}" in text or f"'{job_id}': {status.lower()}" in text:
            return status
    raise AssertionError(proc.stdout + proc.stderr)


def test_ray_job_submit_exit_status_is_the_runs() -> None:
    """A completed run's job SUCCEEDED, a failed run's job FAILED; run dirs and registry written."""
    root = Path(tempfile.mkdtemp(prefix="rj-", dir="/tmp"))  # short: Ray's socket paths are bounded
    ok_dir, bad_dir = root / "runs" / "ok", root / "runs" / "bad"
    try:
        with head_node(root) as head:
            ok = _submit(head, "remedy-ok", [
                "remedy", "run", *GPT, "--run-dir", str(ok_dir), "--quiet", "--", *GPT_ARGS,
            ])  # fmt: skip
            bad = _submit(head, "remedy-bad", [
                "remedy", "run", *TINY, "--run-dir", str(bad_dir), "--quiet", "--", "--raise-at", "3",
            ])  # fmt: skip
            ok_out, _ = ok.communicate(timeout=180)
            bad_out, _ = bad.communicate(timeout=180)
            assert _job_status(head, "remedy-ok") == "SUCCEEDED", ok_out[-3000:]
            assert _job_status(head, "remedy-bad") == "FAILED", bad_out[-3000:]
            assert ok.returncode == 0, ok_out[-3000:]
            assert bad.returncode != 0, bad_out[-3000:]
            assert "rank 0 failed: RuntimeError: loss went sideways at step 3" in bad_out
            summaries = {}
            for run_dir in (ok_dir, bad_dir):
                summaries[run_dir] = json.loads((run_dir / "summary.json").read_text())
                assert (run_dir / "metrics.jsonl").exists() and (run_dir / "journal.wal").exists()
            assert summaries[ok_dir]["status"] == "completed"
            assert summaries[ok_dir]["steps_completed"] == 30
            assert summaries[bad_dir]["status"] == "failed"
            # The jobs' drivers recorded their runs: `remedy status` (same HOME) finds both, ended.
            listed = head.run("remedy", "status", "--json")
            assert listed.returncode == 0, listed.stderr
            states = {
                json.loads(line)["run_id"]: json.loads(line)["state"]
                for line in listed.stdout.splitlines()
            }
            assert states == {
                summaries[ok_dir]["run_id"]: "completed",
                summaries[bad_dir]["run_id"]: "failed",
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
