"""`policy check --loop callbacks`: a step the framework callbacks cannot carry out is an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from remedy.cli.main import _parser, main
from remedy.policies import check_policy, load_policy
from remedy.policies import cli as policy_cli
from remedy.policies._loops import LOOPS, for_loop, refused_steps
from remedy.policies._vocab import ACTION_SPECS

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)

# Line 7 holds checkpoint_now (a plain step), line 10 reduce_microbatch (a step with params).
POLICY = """\
version: 1
name: mixed
rules:
  - name: spike
    when: {anomaly: loss_spike}
    do:
      - checkpoint_now:
        on_failure: next
      - shrink_lr: {factor: 0.5}
      - reduce_microbatch: {factor: 2}
  - name: nan
    when: {anomaly: nonfinite_loss}
    do: [rollback, notify]
"""


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "mixed.yaml"
    path.write_text(POLICY)
    return path


def test_callbacks_loop_refuses_each_step_it_cannot_take_at_its_place(tmp_path: Path) -> None:
    """Two refused steps, located at their action names, each with the table's sentence."""
    path = _write(tmp_path)
    assert check_policy(path) == []
    found = check_policy(path, loop="callbacks")
    assert [(d.severity, d.line, d.col) for d in found] == [("error", 7, 9), ("error", 10, 9)]
    for diag, action, step in zip(
        found, ["checkpoint_now", "reduce_microbatch"], [1, 3], strict=True
    ):
        why = ACTION_SPECS[action].under_callbacks
        assert why is not None
        assert diag.message == (
            f"rule 'spike', step {step}: {action} is not applied under the Hugging Face and "
            f"Lightning callbacks: {why}"
        )


def test_a_guard_loop_refuses_nothing_and_loading_is_unchanged(tmp_path: Path) -> None:
    """The default loop is the Guard's: every action; `load_policy` is not affected."""
    path = _write(tmp_path)
    policy = load_policy(path)
    assert refused_steps(policy, "guard") == []
    assert [(x.rule, x.step_index, x.action) for x in refused_steps(policy, "callbacks")] == [
        ("spike", 0, "checkpoint_now"),
        ("spike", 2, "reduce_microbatch"),
    ]


def test_the_bundled_default_policy_under_the_callbacks() -> None:
    """What the callbacks' own default policy holds that they cannot carry out (said in
    docs/frameworks.md): three steps, every other step of it applies there."""
    refused = refused_steps(load_policy("default"), "callbacks")
    assert [(x.rule, x.step_index + 1, x.action) for x in refused] == [
        ("oom-relief", 2, "reduce_microbatch"),
        ("memory-pressure-checkpoint", 1, "checkpoint_now"),
        ("hardware-fault", 1, "checkpoint_now"),
    ]


def test_the_bundled_policies_callback_versions_refuse_nothing() -> None:
    """`for_loop` drops the refused steps (and a rule left with none, unless escalated to);
    the rest of every rule is kept as it was."""
    for name in ("default", "conservative", "llm-pretrain"):
        policy = load_policy(name)
        callbacks = for_loop(policy, "callbacks")
        assert refused_steps(callbacks, "callbacks") == [], name
        assert for_loop(policy, "guard") is policy
    default = for_loop(load_policy("default"), "callbacks")
    oom = default.rule("oom-relief")
    assert oom is not None and [s.action for s in oom.steps] == ["enable_activation_checkpointing"]
    llm = load_policy("llm-pretrain")
    kept = {r.name for r in for_loop(llm, "callbacks").rules}
    dropped = {r.name for r in llm.rules} - kept
    assert dropped and all(
        all(s.action == "replay_step" for s in r.steps) for r in llm.rules if r.name in dropped
    )


def test_check_main_and_both_clis_take_the_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m remedy.policies check --loop` and `remedy policy check --loop`: exit 1 with the
    located errors under the callbacks, 0 under the Guard; an unknown loop is a usage error."""
    path = str(_write(tmp_path))
    assert policy_cli.check_main([path], strict=False, loop="callbacks") == 1
    assert f"{path}:10:9: error: rule 'spike', step 3" in capsys.readouterr().err
    assert main(["policy", "check", "--loop", "callbacks", path]) == 1
    assert f"{path}:7:9: error:" in capsys.readouterr().err
    assert main(["policy", "check", "--loop", "guard", path]) == 0
    assert capsys.readouterr().out == f"{path}: ok\n"
    assert main(["policy", "check", "--loop", "trainer", path]) == 2
    assert "invalid choice: 'trainer'" in capsys.readouterr().err
    proc = subprocess.run(
        [sys.executable, "-m", "remedy.policies", "check", "--loop", "callbacks", path],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.count(": error: ") == 2


def test_the_supervisor_cli_offers_the_loops_the_policy_package_knows() -> None:
    """`remedy policy check --loop` names its choices without importing the policy code."""
    sub = next(a for a in _parser()._actions if a.dest == "command")
    policy = sub.choices["policy"]
    check = next(a for a in policy._actions if a.dest == "policy_command").choices["check"]
    loop = next(a for a in check._actions if a.dest == "loop")
    assert tuple(loop.choices) == LOOPS
