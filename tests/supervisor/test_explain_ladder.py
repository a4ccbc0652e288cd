"""`remedy explain` names the escalation ladder's rungs, per incident and per decision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remedy.control.decide import decision_record
from remedy.policies import AnomalyEvent, Engine, load_policy
from remedy.report import ladder_text
from remedy.report.explain import explain
from remedy.rundir.rundata import RunData


def _journal() -> list[dict[str, Any]]:
    """The default policy's decisions for a NaN at step 60 that comes back 9 times."""
    engine = Engine(load_policy("default"), run_id="r")
    lines = []
    tick = 60
    for _ in range(9):
        for d in engine.decide([AnomalyEvent("nonfinite_loss", 0, 60, tick=tick)]):
            lines.append(decision_record(d, "applied"))
            if d.action not in ("notify", "abort"):
                engine.record_outcome(d.decision_id, "applied", tick=tick)
        tick += 40
    return lines


def _run(tmp_path: Path, decisions: list[dict[str, Any]]) -> RunData:
    return RunData(
        path=tmp_path,
        summary={"policy": "default"},
        decisions=decisions,
        anomalies=[],
        metrics=[],
        summary_source="summary.json",
    )


def test_the_overview_lists_each_rung_of_the_incident(tmp_path: Path) -> None:
    """Rung 0 twice (the policy's chain), rungs 1-3 twice each, the stop with its reason."""
    text = explain(_run(tmp_path, _journal()))
    block = text[text.index("escalation ladder (") :]
    names = [line.split(":")[0].strip() for line in block.splitlines()[2:-1]]
    assert names == ["rung 0 policy"] * 2 + ["rung 1 durable"] * 2 + ["rung 2 older"] * 2 + [
        "rung 3 skip"
    ] * 2 + ["rung 4 stop"]
    assert "nonfinite_loss at step 60 (rule 'nan-rollback')" in block
    assert block.splitlines()[-1].strip().startswith("stopped: nonfinite_loss at step 60 came back")


def test_a_rung_decision_says_which_rung_and_why(tmp_path: Path) -> None:
    """Asked about one rung's decision, explain says it came back and which rung it stands on."""
    journal = _journal()
    durable = next(d for d in journal if (ladder_text.ladder_of(d) or {}).get("rung") == 1)
    text = explain(_run(tmp_path, journal), decision=durable["decision_id"])
    assert "escalation ladder: nonfinite_loss at step 60 came back after a rewind" in text
    assert "climbed to rung 1 of 4 (durable)" in text
    assert "seen 3 times on rung 0" in text


def test_a_run_without_the_ladder_has_no_such_section(tmp_path: Path) -> None:
    """Decisions that no ladder issued give no ladder lines."""
    journal = _journal()[:2]
    assert ladder_text.overview_lines(journal) == []
    assert ladder_text.decision_line(journal[0]) is None
