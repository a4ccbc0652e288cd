"""`remedy logs RUN` of an ended run: readable lines from its run directory, in time order."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.cli import registry
from remedy.cli.main import main
from tests.supervisor.runs import supervised

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(240)]


def test_logs_of_an_ended_run(
    ray_cluster: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The ranks' output (kept in output.jsonl), the anomaly, the decisions and the job's
    changes, one readable line each and in the order they happened; no raw journal records."""
    monkeypatch.setenv(registry.HOME_ENV, str(tmp_path / "home"))
    run_dir = tmp_path / "run"
    faults = [{"kind": "nan_loss", "at_step": 20, "rank": 0}]
    summary = supervised(run_dir, faults=faults, argv=["--steps", "40"])
    assert summary["status"] == "completed"
    assert (run_dir / "output.jsonl").is_file()
    registry.register(summary["run_id"], {"run_dir": str(run_dir)})

    assert main(["logs", summary["run_id"]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not [x for x in lines if x.startswith(("journal:", "{"))], lines

    def first(text: str) -> int:
        return next(i for i, x in enumerate(lines) if text in x)

    started = first("remedy: supervisor started, policy default")
    training = first("[rank 0] user: training starts")
    anomaly = first("anomaly: nonfinite_loss on rank 0 at step 20")
    decision = first("remedy: step 20: ")
    ended = first("remedy: run ended: completed")
    assert started < training < anomaly <= decision < ended
    assert first("[rank 0] user: step 10 ") < anomaly < first("[rank 0] user: step 30 "), lines
    assert lines[-1].startswith(f"remedy: run {summary['run_id']} ended: completed")
    assert "anomalies: nonfinite_loss x1" in lines[-1]
