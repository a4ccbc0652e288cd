"""The run directory's writers: metrics records written a batch at a time read as written one by one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from remedy.rundir.writer import RunDir, _jsonl_logger, read_jsonl


def test_metrics_many_writes_the_lines_the_structlog_writer_gives(tmp_path: Path) -> None:
    """One write of a batch's records gives, line for line, the structlog writer's lines
    (same keys in the same order, NaN and nested values alike), timestamps aside."""
    records = [
        {"step": s, "tick": s, "rank": 0, "loss": math.nan if s == 1 else 2.5, "lr": 3e-4,
         "loss_scale": None, "chaos": [{"kind": "nan_loss", "step": s}]}
        for s in range(3)
    ]  # fmt: skip
    run_dir = RunDir(tmp_path / "run", "r")
    run_dir.metrics_many(records)
    run_dir.metrics(records[0])
    run_dir.close()
    with open(tmp_path / "reference.jsonl", "w", buffering=1, encoding="utf-8") as fh:
        logger = _jsonl_logger(fh)
        for record in [*records, records[0]]:
            logger.msg("metrics", **record)
    got = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    want = (tmp_path / "reference.jsonl").read_text().splitlines()
    assert [json.loads(g).keys() for g in got] == [json.loads(w).keys() for w in want]
    assert [g[: g.index('"ts"')] for g in got] == [w[: w.index('"ts"')] for w in want]
    assert [r["ts"].endswith("Z") for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [
        True
    ] * 4
    run_dir.metrics_many([])  # nothing to write opens nothing


def test_an_anomaly_keeps_when_its_rank_saw_it_beside_when_it_was_written(tmp_path: Path) -> None:
    """A line's `ts` is its write time; the event's own time survives as `detected_at`, which
    `remedy logs` places it by (the rank printed more steps while its report travelled)."""
    rd = RunDir(tmp_path, "r1")
    rd.anomaly({"kind": "nonfinite_loss", "rank": 0, "step": 20, "ts": 1_700_000_000.25})
    rd.anomaly({"kind": "rank_hang", "rank": 1, "step": 3})  # no time of its own: none added
    first, second = read_jsonl(tmp_path / "anomalies.jsonl")
    assert first["detected_at"] == 1_700_000_000.25 and isinstance(first["ts"], str)
    assert "detected_at" not in second


def test_journal_wal_takes_state_records_only_and_the_history_the_rest(tmp_path: Path) -> None:
    """journal.wal is what a restarted supervisor resumes from: a record of another type is
    refused there with a sentence (nothing written), and goes to history.jsonl."""
    run_dir = RunDir(tmp_path, "r")
    run_dir.wal({"type": "state", "schema": 8})
    run_dir.wal({"type": "state_delta", "set": {}})
    with pytest.raises(ValueError, match=r"journal\.wal holds state records only, not 'decided'"):
        run_dir.wal({"type": "decided", "decision": {}})
    run_dir.history({"type": "decided", "decision": {}})
    run_dir.close()
    assert [r["type"] for r in read_jsonl(tmp_path / "journal.wal")] == ["state", "state_delta"]
    [decided] = read_jsonl(tmp_path / "history.jsonl")
    assert decided["type"] == "decided" and decided["run_id"] == "r" and decided["ts"]
