"""`remedy explain` tells why a decision was taken and what a rule did, from a real run's journal."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from remedy.cli.main import main
from remedy.report.explain import explain
from remedy.rundir.rundata import load_run
from tests.supervisor.runs import supervised

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

# A NaN gradient told (notify), one firing (rollback + LR cut) whose rollback
# undoes the steps after that notify, then a NaN inside the cooldown (held
# back), then one after it with max_fires used up (escalates to notify).
POLICY = """\
version: 1
name: explain-test
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss, severity: warning}
    do:
      - rollback: {steps_back: 5, skip_batches: 2}
      - shrink_lr: {factor: 0.5}
    cooldown_steps: 30
    max_fires: 1
    on_exhausted: notify
  - name: grad-told
    when: {anomaly: nonfinite_grad}
    do:
      - notify: {message: "a non-finite gradient"}
    cooldown_steps: 100
"""


@pytest.fixture(scope="module")
def run_dir(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("explain")
    policy = path / "policy.yaml"
    policy.write_text(POLICY)
    faults = [{"kind": "nan_loss", "at_step": s, "rank": 0} for s in (20, 25, 50)]
    faults.append({"kind": "nan_grad", "at_step": 12, "rank": 0})
    summary = supervised(path / "run", faults=faults, argv=["--steps", "70"], policy=str(policy))
    assert summary["status"] == "completed"
    return path / "run"


def test_explain_rollback_decision(run_dir: Path) -> None:
    """The rollback: its event, each predicate with the value seen, what was done, loss before and after."""
    run = load_run(run_dir)
    rollback = next(
        d for d in run.decisions if d["action"] == "rollback" and d["outcome"] == "applied"
    )
    text = explain(run, decision=rollback["decision_id"][-6:])
    # The event names the node its rank ran on (stamped by the supervisor).
    assert re.search(r"nonfinite_loss on rank 0 \(node [^)]+\) at step 20 \(tick 20\)", text), text
    assert "anomaly: nonfinite_loss in ['nonfinite_loss'] -> holds" in text
    assert "severity: critical >= warning -> holds" in text
    assert "cooldown 30 steps; max_fires 1 in the run, then notify" in text
    assert (
        "restored step" in text
        and "step 1 of a chain of 2; the others: shrink_lr [applied]" in text
    )
    assert "loss before: " in text and "loss after:  " in text and "n/a" not in text


def test_explain_rule_shows_firing_hold_back_and_escalation(run_dir: Path) -> None:
    """For the rule: one firing, the NaN held back by its cooldown, the escalation once max_fires is used up."""
    text = explain(load_run(run_dir), rule="nan-rollback")
    lines = text.splitlines()
    assert "fired 1 time(s), held back" in text and "escalated 1 time(s)" in text
    assert any("step 20: fired: rollback" in line for line in lines)
    held = [line for line in lines if "held back: rollback" in line]
    assert held and any("cool" in line for line in held), "the cooldown is named as the reason"
    assert any("escalated (applied): notify" in line and "max_fires=1" in line for line in lines)


def test_explain_cli_step_and_errors(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`remedy explain DIR --step N` explains that step's decisions; unknown ids and rules are usage errors."""
    assert main(["explain", str(run_dir), "--step", "20"]) == 0
    out = capsys.readouterr().out
    assert out.count("decision ") >= 2 and "shrink_lr" in out
    assert main(["explain", str(run_dir)]) == 0
    assert "ask about one with --decision ID" in capsys.readouterr().out
    assert main(["explain", str(run_dir), "--decision", "nope"]) == 2
    assert main(["explain", str(run_dir), "--rule", "no-such-rule"]) == 2
    assert main(["explain", str(run_dir), "--step", "999"]) == 2


def test_explain_after_a_rollback_uses_the_kept_steps(run_dir: Path) -> None:
    """ "What training did next" after the notify at step 12 is what was kept: the
    rollback from step 20 undid the steps after it, so training went on from the
    step that rollback restored, not at step 13."""
    run = load_run(run_dir)
    told = next(d for d in run.decisions if d["rule"] == "grad-told")
    rollback = next(
        d for d in run.decisions if d["action"] == "rollback" and d["outcome"] == "applied"
    )
    restored = rollback["result"]["restored_step"]
    assert told["step"] == 12 and restored <= 12
    text = explain(run, decision=told["decision_id"][-6:])
    assert f"training went on at step {restored} (tick " in text
    assert "training went on at step 13 " not in text


def test_explain_of_a_live_run_re_evaluates_the_rule(run_dir: Path, tmp_path: Path) -> None:
    """While the run goes on (no summary.json yet) the rule is found in the policy the
    supervisor was started with, and its predicates are re-evaluated."""
    live = tmp_path / "live"
    shutil.copytree(run_dir, live)
    (live / "summary.json").unlink()
    run = load_run(live)
    assert run.summary_source == "journals"
    rollback = next(
        d for d in run.decisions if d["action"] == "rollback" and d["outcome"] == "applied"
    )
    text = explain(run, decision=rollback["decision_id"][-6:])
    assert "not in the run's policy" not in text
    assert "anomaly: nonfinite_loss in ['nonfinite_loss'] -> holds" in text
