"""The decision core imports neither torch nor Ray and touches no file: what it journals leaves
as typed effects, in the order the shell must carry them out."""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
from typing import Any

import pytest

from remedy.control.decide import Controller
from remedy.control.effects import (
    AnomalyRecord,
    DecisionRecord,
    HistoryRecord,
    MetricRecords,
)
from remedy.policies import AnomalyEvent, Engine, load_policy_text

POLICY = """
version: 1
name: purity
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 10, skip_batches: 0}
"""

# What importing every module of the core may bring in from remedy besides the core itself.
ALLOWED = {
    "remedy",
    "remedy._lazy",  # the packages' names loaded on first use
    "remedy.protocol",  # what crosses a process boundary:
    "remedy.protocol.commands",  # the command and outcome records ranks and core exchange
    "remedy.protocol.phases",  # the names of a rank's phases, which the hang watch reads
    "remedy.protocol.reports",  # report batches and their validation
}


@pytest.mark.timeout(120)
def test_the_core_imports_neither_torch_nor_ray() -> None:
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import remedy.control as core\n"
        "for m in pkgutil.iter_modules(core.__path__):\n"
        "    importlib.import_module('remedy.control.' + m.name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "                        ('remedy', 'torch', 'ray'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=100
    ).stdout
    modules = set(json.loads(out))
    assert not {m for m in modules if m.split(".")[0] in ("torch", "ray")}
    outside = {
        m
        for m in modules
        if not m.startswith(("remedy.control", "remedy.policies")) and m not in ALLOWED
    }
    assert outside == set()


def test_a_decision_and_its_outcome_are_journaled_as_effects_without_a_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A NaN -> rollback decided -> both ranks applied it, with `open` failing throughout: the
    journal is the effects, in write-ahead order."""
    engine = Engine(load_policy_text(POLICY, "purity.yaml"), run_id="r")
    c = Controller(engine, world_size=2)
    c.incidents.hold_s = 0.0  # decided on the first report (incidents are tested elsewhere)

    def no_files(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the core opened a file")

    monkeypatch.setattr(builtins, "open", no_files)
    nan = AnomalyEvent("nonfinite_loss", 0, 5, value=float("nan"), severity="critical")
    step = {"rank": 0, "step": 5, "time_s": 0.1, "loss": float("nan")}
    batch = {"rank": 0, "step": 5, "tick": 5, "events": [nan.to_dict()], "metrics": [step]}
    [command] = c.ingest(batch)
    # The step record, the anomaly, then the decision, written ahead of the command that
    # carries it: the shell takes and carries each out before it replies.
    effects = c.take_effects()
    assert [type(e) for e in effects] == [MetricRecords, AnomalyRecord, HistoryRecord]
    assert isinstance(effects[1], AnomalyRecord) and effects[1].record["kind"] == "nonfinite_loss"
    decided = effects[2]
    assert isinstance(decided, HistoryRecord) and decided.record["type"] == "decided"
    assert decided.record["command"]["decision_id"] == command["decision_id"]
    for rank in (0, 1):
        outcome = {
            "decision_id": command["decision_id"],
            "rank": rank,
            "outcome": "applied",
            "step": 6,
            "tick": 6,
            "detail": "restored step 0",
        }
        c.ingest({"rank": rank, "step": 6, "tick": 6, "outcomes": [outcome]})
    effects = c.take_effects()
    # Resolved once every rank has reported, then the decision's line with its outcome.
    assert [type(e) for e in effects] == [HistoryRecord, DecisionRecord]
    resolved, line = effects
    assert isinstance(resolved, HistoryRecord) and isinstance(line, DecisionRecord)
    assert resolved.record == {
        "type": "resolved",
        "decision_id": command["decision_id"],
        "outcome": "applied",
    }
    assert (line.record["action"], line.record["outcome"]) == ("rollback", "applied")
    assert c.decisions == [line.record]
