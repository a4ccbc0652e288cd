"""`remedy report` renders a PNG timeline and an HTML page for completed, crashed and standalone runs."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from remedy.cli.main import main
from remedy.report.html import timeline, write_report
from remedy.rundir.rundata import load_run
from remedy.rundir.writer import read_jsonl
from tests.supervisor.runs import standalone, supervised

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Tables(HTMLParser):
    """Rows of each <table class=...> as lists of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = dict(attrs).get("class") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row is not None and self._table is not None:
            if self._row:
                self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def tables(page: Path) -> dict[str, list[list[str]]]:
    parser = _Tables()
    parser.feed(page.read_text())
    return parser.tables


def check_report(run_dir: Path, out: Path) -> dict[str, list[list[str]]]:
    """Render the report; check both files are real and the decision table is the journal's."""
    png, page = write_report(run_dir, out)
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000, "a real multi-panel figure"
    text = page.read_text()
    assert 'src="data:image/png;base64,' in text and len(text) > len(data), "figure embedded"
    found = tables(page)
    journal = sorted(read_jsonl(run_dir / "decisions.jsonl"), key=lambda d: d["decision_id"])
    rows = found["decisions"]
    assert [(r[0], r[3], r[5], r[7]) for r in rows] == [
        (d["decision_id"], d["rule"], d["action"], d["outcome"]) for d in journal
    ]
    assert len(found["anomalies"]) == len(read_jsonl(run_dir / "anomalies.jsonl"))
    return found


@pytest.fixture(scope="module")
def chaos_run(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("chaos")
    summary = supervised(
        run_dir, faults=[{"kind": "nan_loss", "at_step": 40, "rank": 0}], argv=["--steps", "80"]
    )
    assert summary["status"] == "completed"
    return run_dir


@pytest.mark.slow
def test_report_of_a_chaos_run_shows_rollback_lr_cut_and_skips(
    chaos_run: Path, tmp_path: Path
) -> None:
    """A NaN rolled back with skipped batches and an LR cut: PNG and HTML exist, decisions match the journal."""
    found = check_report(chaos_run, tmp_path)
    actions = {r[5] for r in found["decisions"]}
    assert {"rollback", "shrink_lr"} <= actions
    rollback = next(
        d for d in read_jsonl(chaos_run / "decisions.jsonl") if d["action"] == "rollback"
    )
    assert rollback["result"]["skipped_batches"], "the run really skipped batches"
    summary = dict(found["summary"])
    assert summary["status"] == "completed"


def test_report_of_a_crashed_run(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A run whose training function raised is reported as failed, with the rank's error."""
    run_dir = tmp_path_factory.mktemp("crashed")
    summary = supervised(
        run_dir,
        faults=[{"kind": "nan_loss", "at_step": 15, "rank": 0}],
        argv=["--steps", "80", "--crash-at", "35"],
    )
    assert summary["status"] == "failed"
    found = check_report(run_dir, tmp_path)
    facts = dict(found["summary"])
    assert facts["status"] == "failed"
    assert "user code failed at step 35" in facts["rank 0 error"]


def test_report_of_a_standalone_run(tmp_path: Path) -> None:
    """A Guard run alone with run_dir= writes summary.json; cut short without one, the journals serve."""
    run_dir = tmp_path / "alone"
    standalone(run_dir, "--steps", "60", "--nan-at", "30")
    run = load_run(run_dir)
    assert run.summary_source == "summary.json" and run.summary["status"] == "completed"
    assert run.summary["steps_completed"] == 60
    assert run.summary["steps_executed"] > 60, "the rollback re-ran steps"
    check_report(run_dir, tmp_path / "out")
    # A standalone run killed before its end leaves only the journals.
    (run_dir / "summary.json").unlink()
    run = load_run(run_dir)
    assert run.summary["standalone"] and run.summary["steps_completed"] == 60
    assert run.summary["steps_executed"] > 60
    found = check_report(run_dir, tmp_path / "out2")
    assert "standalone" in dict(found["summary"])["status"]


def test_report_cli_writes_files_and_refuses_a_non_run(
    chaos_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`remedy report DIR --out OUT` prints the summary and writes both files; a non-run dir is a usage error."""
    assert main(["report", str(chaos_run), "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "completed" in captured.out and "nan-rollback: rollback" in captured.out
    assert (tmp_path / "report.png").is_file() and (tmp_path / "report.html").is_file()
    assert main(["report", str(chaos_run), "--json", "--no-files"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "completed"
    assert main(["report", str(tmp_path / "nothing")]) == 2


def test_running_run_is_reported_from_its_journals(tmp_path: Path) -> None:
    """A run dir with journals still being written and no summary reads as running."""
    record: dict[str, Any] = {"step": 0, "tick": 0, "rank": 0, "loss": 1.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "anomalies.jsonl").write_text("")
    run = load_run(tmp_path)
    assert run.status == "running"
    png, page = write_report(tmp_path)
    assert png.is_file() and "running" in page.read_text()


TWO_ON_ONE_STEP = """\
version: 1
name: two-on-one-step
rules:
  - name: nan-told-twice
    when: {anomaly: nonfinite_loss}
    do:
      - notify: {message: "a non-finite loss"}
      - notify: {message: "told again"}
"""


def test_labels_of_actions_on_the_same_step_do_not_overlap(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Two actions at one step get two labels on the loss panel, drawn apart."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(TWO_ON_ONE_STEP)
    run_dir = tmp_path / "run"
    faults = [{"kind": "nan_loss", "at_step": 20, "rank": 0}]
    summary = supervised(run_dir, faults=faults, argv=["--steps", "40"], policy=str(policy))
    assert summary["status"] == "completed"
    run = load_run(run_dir)
    fig = timeline(run)
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    loss_ax = fig.axes[0]
    labels = [t for t in loss_ax.texts if t.get_text() == "notify"]
    assert len(labels) == 2
    a, b = (t.get_window_extent(renderer) for t in labels)
    assert not a.overlaps(b), (a, b)


def test_a_supervisor_outage_is_a_band_over_the_steps_trained_without_it(tmp_path: Path) -> None:
    """Steps 0-9 written before the outage, 10-24 held by the ranks and written after it."""
    from remedy.report.html import outage_steps  # noqa: PLC0415

    def iso(t: float) -> str:
        import datetime  # noqa: PLC0415

        return (
            datetime.datetime.fromtimestamp(t, tz=datetime.UTC).isoformat().replace("+00:00", "Z")
        )

    t0 = 1_800_000_000.0
    metrics = [{"step": s, "tick": s, "rank": 0, "loss": 1.0 / (s + 1), "ts": iso(t0 + s * 0.1)}
               for s in range(10)]  # fmt: skip
    metrics += [{"step": s, "tick": s, "rank": 0, "loss": 1.0 / (s + 1), "ts": iso(t0 + 20.0)}
                for s in range(10, 25)]  # fmt: skip
    metrics += [{"step": 25, "tick": 25, "rank": 0, "loss": 0.04, "ts": iso(t0 + 20.5)}]
    outage = {"began": t0 + 1.0, "noticed": t0 + 11.0, "ended": t0 + 19.9, "duration_s": 18.9,
              "noticed_after_s": 10.0, "noticed_by": ["rank 0"], "killed": t0 + 11.0,
              "how": "killed its process (pid 7, SIGKILL) by rank 0"}  # fmt: skip
    summary = {"run_id": "r", "status": "completed", "steps_completed": 26, "steps_executed": 26,
               "goodput": 1.0, "supervisor_outages": [outage]}  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    run = load_run(tmp_path)
    assert outage_steps(run, outage) == (9, 24)
    _, page = write_report(run)
    facts = dict(tables(page)["summary"])
    assert facts["supervisor outages"] == (
        "18.9 s without an answer, noticed after 10.0 s by rank 0: "
        "killed its process (pid 7, SIGKILL) by rank 0"
    )
