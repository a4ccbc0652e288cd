"""A detached run on a `ray start` cluster, reached from other shells: status, logs, attach, stop.

`remedy run --detach` returns at once with the run id; the run goes on
without the command that started it. `remedy status`, `logs`, `attach` and
`stop` then find it through the registry and talk to its supervisor with the
run's token; one holding another token is refused and counted. `stop` writes
a final checkpoint on the rank, then ends the run with status `stopped`.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.supervisor.headnode import REPO, Head, head_node

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(480)]

TINY = f"{REPO / 'tests' / 'robustness' / 'targets' / 'tiny.py'}:main"
# Long enough to outlast the test; `remedy stop` ends it.
TRAIN = [
    "--steps",
    "100000",
    "--sleep",
    "0.02",
    "--checkpoint-every",
    "1000000",
    "--say-every",
    "20",
]


def _status(head: Head, run_id: str) -> dict[str, object]:
    proc = head.run("remedy", "status", run_id)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def _registry_entry(head: Head, run_id: str) -> Path:
    return Path(head.env["REMEDY_HOME"]) / "runs" / f"{run_id}.json"


def test_detached_run_is_watched_and_stopped_from_other_shells() -> None:
    """--detach returns with the run id; status, logs and attach reach the run, a foreign token
    is refused and counted, Ctrl-C of attach leaves it going, and stop ends it cleanly."""
    root = Path(tempfile.mkdtemp(prefix="rd-", dir="/tmp"))
    run_dir = root / "runs" / "detached"
    try:
        with head_node(root) as head:
            started = head.run(
                "remedy", "run", TINY, "--address", "auto", "--run-dir", str(run_dir),
                "--detach", "--", *TRAIN,
            )  # fmt: skip
            assert started.returncode == 0, started.stderr
            run_id = started.stdout.strip()
            assert run_id and "\n" not in run_id, started.stdout
            assert f"remedy stop {run_id}" in started.stderr
            # The command that started it has exited; the run trains on.
            deadline = time.monotonic() + 120
            while _lines(run_dir / "metrics.jsonl") < 30:
                assert time.monotonic() < deadline, "the detached run never trained"
                time.sleep(0.5)

            logs = head.run("remedy", "logs", run_id)
            assert logs.returncode == 0, logs.stderr
            assert "[rank 0] tiny: step 20" in logs.stdout

            # Another run's token (the entry edited): refused with one line, and counted.
            entry_path = _registry_entry(head, run_id)
            entry = json.loads(entry_path.read_text())
            entry_path.write_text(json.dumps({**entry, "token": "0" * 32}))
            refused = head.run("remedy", "status", run_id)
            assert refused.returncode == 1, refused.stderr
            assert f"run {run_id} refused the call: the token" in refused.stderr
            assert "Traceback" not in refused.stderr
            entry_path.write_text(json.dumps(entry))
            status = _status(head, run_id)
            assert status["state"] == "running" and status["policy"] == "default"
            assert dict(status["rejected"]) == {"token": 1}  # type: ignore[call-overload]
            assert int(dict(status["step"])["0"]) >= 30  # type: ignore[call-overload]
            assert isinstance(status["recent_decisions"], list)

            # attach shows the live feed; Ctrl-C detaches, and the run goes on.
            attach = subprocess.Popen(
                [sys.executable, "-m", "remedy.cli", "attach", run_id, "--quiet"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=head.env,
            )  # fmt: skip
            assert attach.stdout is not None
            seen = [json.loads(attach.stdout.readline()) for _ in range(3)]
            assert {e["event"] for e in seen} <= {
                "output",
                "anomaly",
                "decision",
                "progress",
                "missed",
            }
            attach.send_signal(signal.SIGINT)
            _, attach_err = attach.communicate(timeout=60)
            assert attach.returncode == 0, attach_err
            assert "detached; the run goes on" in attach_err and "Traceback" not in attach_err

            # Every supervised run of the cluster, by its address: this one goes on after attach.
            listed = head.run("remedy", "status", "--address", head.address)
            assert listed.returncode == 0, listed.stderr
            assert [json.loads(x)["state"] for x in listed.stdout.splitlines()] == ["running"]

            # SIGTERM stops a `logs -f` cleanly (no Ray stack), and the run goes on.
            termed = subprocess.Popen(
                [sys.executable, "-m", "remedy.cli", "logs", run_id, "-f"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=head.env,
            )  # fmt: skip
            assert termed.stdout is not None
            assert termed.stdout.readline(), "logs -f printed nothing"
            termed.send_signal(signal.SIGTERM)
            termed_out, termed_err = termed.communicate(timeout=60)
            assert termed.returncode == 0, termed_err
            assert f"remedy: stopped following run {run_id}; it goes on" in termed_out
            assert "SIGTERM" not in termed_err and "Traceback" not in termed_err, termed_err
            assert _status(head, run_id)["state"] == "running"

            # `logs -f` follows until the run ends (here, by the stop below).
            follow = subprocess.Popen(
                [sys.executable, "-m", "remedy.cli", "logs", run_id, "-f"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=head.env,
            )  # fmt: skip
            assert follow.stdout is not None
            assert follow.stdout.readline(), "logs -f printed nothing"
            stopped = head.run("remedy", "stop", run_id, timeout=200)
            assert stopped.returncode == 0, stopped.stderr
            assert f"run {run_id} stopped at step" in stopped.stdout
            follow_out, follow_err = follow.communicate(timeout=120)
            assert follow.returncode == 0, follow_err
            assert f"remedy: run {run_id} ended: stopped" in follow_out
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["status"] == "stopped" and summary["stop_reason"] == "remedy stop"
            assert 30 <= summary["steps_completed"] < 100000
            decisions = [
                json.loads(x) for x in (run_dir / "decisions.jsonl").read_text().splitlines()
            ]
            final = [d for d in decisions if d["rule"] == "remedy stop"]
            assert [(d["action"], d["outcome"]) for d in final] == [("checkpoint_now", "applied")]
            step = final[0]["applied_at_step"]
            assert list((run_dir / "checkpoints").glob(f"*{step}*")), (
                "the final checkpoint is on disk"
            )
            history = [
                json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()
            ]
            assert any(r.get("type") == "stop_requested" for r in history)
            job = [r for r in history if r.get("type") == "job_state"]
            assert [r["to"]["phase"] for r in job][-2:] == ["aborting", "aborted"], job
            assert job[-2]["reason"] == "aborting: an operator's stop: remedy stop", job[-2]

            # Ended: status and logs read the run directory; a second stop is one line.
            after = _status(head, run_id)
            assert after["state"] == "stopped" and after["ended"] is True
            again = head.run("remedy", "stop", run_id)
            assert again.returncode == 1 and "has ended already (stopped)" in again.stderr
            ended_logs = head.run("remedy", "logs", run_id)
            assert (
                ended_logs.returncode == 0
                and "remedy stop -> checkpoint_now [applied]" in ended_logs.stdout
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
