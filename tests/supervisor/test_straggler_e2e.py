"""A rank that is slow on every step is reported as a straggler by the supervisor, and only that rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from remedy.rundir.writer import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

TARGET = f"{Path(__file__).resolve().parent / 'straggler_train.py'}:main"


def test_slow_rank_is_found_through_ddp(ray_cluster: None, tmp_path: Path) -> None:
    """Rank 1 sleeps 0.15 s per step under 2-rank gloo DDP: one straggler event, for rank 1."""
    # A straggler is reported, never replaced: no warm spare to start.
    spec = RunSpec(target=TARGET, workers=2, run_dir=str(tmp_path), spares=0)
    summary = run_supervised(spec)
    assert summary["status"] == "completed", summary
    found = [a for a in read_jsonl(tmp_path / "anomalies.jsonl") if a["kind"] == "straggler"]
    assert [a["rank"] for a in found] == [1], found
    assert found[0]["source"] == "supervisor"
    assert summary["anomalies"]["straggler"] == 1
    # The all-reduce made rank 0 wait: its time there is in the metrics, and was taken out.
    waits = [
        m.get("collective_s") for m in read_jsonl(tmp_path / "metrics.jsonl") if m["rank"] == 0
    ]
    assert waits and all(isinstance(w, float) for w in waits)
    (decision,) = [
        d for d in read_jsonl(tmp_path / "decisions.jsonl") if d["anomaly"]["kind"] == "straggler"
    ]
    assert (decision["rule"], decision["action"], decision["outcome"]) == (
        "notify-rest",
        "notify",
        "applied",
    )
