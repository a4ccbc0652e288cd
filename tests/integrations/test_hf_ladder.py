"""Under HF's Trainer, a NaN that comes back at the same step after every rollback climbs the
escalation ladder and stops the run with the reason, instead of looping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from remedy.rundir.writer import read_jsonl

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(600)]

MAX_STEPS = 400
NAN_AT = 40  # remedy's step whose loss is NaN every time it runs


@pytest.mark.slow
def test_a_nan_tied_to_one_step_climbs_the_ladder_and_stops_the_trainer(tmp_path: Path) -> None:
    """Two rollbacks from memory; the durable rungs fail (the callbacks keep no checkpoints of
    remedy's) and climb at once; two rollbacks skipping a range; then notify and abort, every
    rung journaled in order, and the Trainer stops well before its last step."""
    from remedy.integrations.hf import RemedyCallback  # noqa: PLC0415 - after the importorskip
    from tests.integrations.hf_builders import CountingTokens, cpu_args, tiny_gpt2  # noqa: PLC0415

    model = tiny_gpt2()
    callback = RemedyCallback(run_dir=tmp_path / "run")

    def poison(module: Any, inputs: Any, output: Any) -> Any:
        # A fault tied to the step (the step's own data or state, not a batch a skip avoids).
        if callback.guard is not None and callback.guard.step_count == NAN_AT:
            output.loss = output.loss * float("nan")
        return output

    model.register_forward_hook(poison)
    trainer = transformers.Trainer(
        model=model,
        args=cpu_args(tmp_path / "out", MAX_STEPS, logging_steps=10_000),
        train_dataset=CountingTokens(4 * MAX_STEPS),
        callbacks=[callback],
    )
    trainer.train()

    assert trainer.state.global_step < MAX_STEPS, "the run stopped instead of looping"
    decisions = read_jsonl(tmp_path / "run" / "decisions.jsonl")
    rungs = [
        ((d["anomaly"].get("details") or {}).get("ladder") or {}).get("rung", 0)
        for d in decisions
        if d["action"] in ("rollback", "abort") and d["outcome"] != "suppressed"
    ]
    outcomes = [
        d["outcome"]
        for d in decisions
        if d["action"] in ("rollback", "abort") and d["outcome"] != "suppressed"
    ]
    assert rungs == [0, 0, 1, 2, 3, 3, 4], decisions
    assert outcomes == ["applied", "applied", "escalated", "escalated", "applied", "applied",
                        "applied"]  # fmt: skip
    assert {d["rule"] for d in decisions if d["action"] == "rollback"} == {"nan-rollback"}
    abort = next(d for d in decisions if d["action"] == "abort")
    assert "came back after every rung of the escalation ladder" in abort["params"]["reason"]
    assert any(d["action"] == "notify" and d["outcome"] == "applied" for d in decisions)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "aborted", summary
