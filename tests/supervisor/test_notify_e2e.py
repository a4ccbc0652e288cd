"""`remedy run` with REMEDY_NOTIFY_WEBHOOK set: a notify decision reaches a real local server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remedy.rundir.writer import read_jsonl
from tests.paths import PYTHONPATH
from tests.supervisor.test_notify import Sink, deliveries

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
TINY = f"{REPO / 'tests' / 'robustness' / 'targets' / 'tiny.py'}:main"
POLICY = """
version: 1
name: tell
rules:
  - name: nan-tell
    when: {anomaly: nonfinite_loss}
    do: [{notify: {message: a NaN loss; someone should look}}]
    max_fires: 1
"""


@pytest.mark.slow
def test_a_notify_decision_is_delivered_from_a_supervised_run(tmp_path: Path) -> None:
    """The webhook gets the run id, rule, kind, ranks and step; the journal and explain say delivered."""
    policy = tmp_path / "tell.yaml"
    policy.write_text(POLICY)
    chaos = tmp_path / "chaos.yaml"
    chaos.write_text("faults:\n  - {kind: nan_loss, at_step: 4, rank: 0}\n")
    run_dir = tmp_path / "run"
    sink = Sink()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PYTHONPATH=PYTHONPATH,
        HOME=str(tmp_path),
        REMEDY_HOME=str(tmp_path / ".remedy"),
    )
    env["REMEDY_NOTIFY_WEBHOOK"] = sink.url + "/remedy"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "remedy.cli", "run", TINY, "--policy", str(policy),
             "--chaos", str(chaos), "--run-dir", str(run_dir), "--quiet", "--", "--steps", "12"],
            capture_output=True, text=True, check=False, timeout=200, env=env,
        )  # fmt: skip
    finally:
        sink.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = deliveries(run_dir / "notifications.jsonl", 1)
    (decision,) = [d for d in read_jsonl(run_dir / "decisions.jsonl") if d["action"] == "notify"]
    assert line["outcome"] == "delivered" and line["decision_id"] == decision["decision_id"]
    assert "sending to webhook (generic, $REMEDY_NOTIFY_WEBHOOK)" in decision["detail"]
    path, body = sink.requests[0]
    assert path == "/remedy"
    assert body["run_id"] == decision["run_id"] and body["rule"] == "nan-tell"
    assert body["anomaly"] == "nonfinite_loss" and body["ranks"] == [0] and body["step"] == 4
    assert body["message"] == "a NaN loss; someone should look"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["notifications"] == {"delivered": 1, "failed": 0}
    explained = subprocess.run(
        [sys.executable, "-m", "remedy.cli", "explain", str(run_dir),
         "--decision", decision["decision_id"]],
        capture_output=True, text=True, check=False, timeout=60, env=env,
    )  # fmt: skip
    assert explained.returncode == 0, explained.stderr
    assert "delivered to webhook (generic, $REMEDY_NOTIFY_WEBHOOK)" in explained.stdout
