"""`remedy run --workers 2`: a NaN loss that comes back at the same step after every rollback
climbs the escalation ladder rung by rung (memory, durable checkpoint, older checkpoint, skipped
range) and the run stops with the reason, exit 3, instead of looping; `remedy explain` lists
the rungs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import PYTHONPATH, REPO

TARGET = f"{REPO / 'examples' / 'pretrain_gpt.py'}:main"
NAN_AT = 50
ARGS = ["--steps", "120", "--layers", "1", "--width", "32", "--batch-size", "4",
        "--block-size", "32", "--sample-every", "0", "--checkpoint-every", "10",
        "--checkpoint-keep", "20"]  # fmt: skip


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PYTHONPATH=PYTHONPATH,
        HOME=str(tmp_path),
        REMEDY_HOME=str(tmp_path / ".remedy"),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
    )
    return env


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_nan_at_one_step_climbs_every_rung_then_stops(tmp_path: Path) -> None:
    """Rank 0's loss is NaN each time step 50 runs: two rollbacks from memory, two to the
    newest durable checkpoint, two to an older one, two skipping a range, then notify and
    abort; each rung journaled under nan-rollback with its rung, the run aborted, exit 3."""
    chaos = tmp_path / "nan.yaml"
    chaos.write_text(f"faults:\n  - {{kind: nan_loss, at_step: {NAN_AT}, rank: 0, repeat: 50}}\n")
    run_dir = tmp_path / "run"
    argv = ["run", TARGET, "--workers", "2", "--run-dir", str(run_dir), "--chaos", str(chaos),
            "--", *ARGS]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "remedy.cli", *argv],
        capture_output=True, text=True, check=False, timeout=560, env=_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "aborted"
    assert "came back after every rung of the escalation ladder" in summary["abort_reason"]
    decisions = [
        json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()
    ]
    acted = [d for d in decisions if d["outcome"] != "suppressed"]
    rollbacks = [d for d in acted if d["action"] == "rollback"]
    rungs = [
        (d["anomaly"].get("details") or {}).get("ladder", {}).get("rung", 0) for d in rollbacks
    ]
    assert rungs == [0, 0, 1, 1, 2, 2, 3, 3], rollbacks
    assert all(d["outcome"] == "applied" for d in rollbacks), rollbacks
    assert all(d["step"] == NAN_AT and d["rule"] == "nan-rollback" for d in rollbacks)
    sources = [d["result"]["source"] for d in rollbacks]
    assert sources[2:6] == ["disk"] * 4, sources
    restored = [d["result"]["restored_step"] for d in rollbacks]
    assert restored[2] == restored[3] == 20 and restored[4] == restored[5] == 10, restored
    assert rollbacks[6]["result"]["skipped_count"] == 70
    last = acted[-2:]
    assert [d["action"] for d in last] == ["notify", "abort"], last
    assert all(d["anomaly"]["details"]["ladder"]["name"] == "stop" for d in last)

    text = subprocess.run(
        [sys.executable, "-m", "remedy.cli", "explain", str(run_dir)],
        capture_output=True, text=True, check=True, timeout=120, env=_env(tmp_path),
    ).stdout  # fmt: skip
    assert "escalation ladder" in text
    assert f"nonfinite_loss at step {NAN_AT} (rule 'nan-rollback')" in text
    for name in ("rung 0 policy", "rung 1 durable", "rung 2 older", "rung 3 skip", "rung 4 stop"):
        assert name in text, text
