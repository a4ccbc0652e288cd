"""The policy test runner (`remedy policy test`): passing and failing test files."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.policies import cli
from remedy.policies._runner import run_test_file

POLICY = """\
version: 1
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 50, skip_batches: 20}
      - shrink_lr: {factor: 0.5}
    cooldown_steps: 100
"""

PASSING = """\
policy: policy.yaml
tests:
  - name: nan storm rolls back once
    streams:
      rank0: {nonfinite_loss: "_x100 1x3 _x50"}
      rank1: {nonfinite_loss: "_x100 1x3 _x50"}
    expect:
      - {step: 101, actions: [rollback, shrink_lr], rule: nan-rollback, ranks: [0, 1]}
      - {step: 102, actions: [], suppressed: [nan-rollback]}
    no_decisions: [{from: 102, to: 150}]
"""

FAILING = """\
policy: policy.yaml
tests:
  - name: expects the wrong step
    streams:
      rank0: {nonfinite_loss: "_x100 1"}
    expect:
      - {step: 100, actions: [rollback, shrink_lr]}
  - name: forbids the right step
    streams:
      rank0: {nonfinite_loss: "_x100 1"}
    no_decisions: [{from: 1, to: 200}]
  - name: passes
    streams:
      rank0: {nonfinite_loss: "_x100 1"}
    expect:
      - {step: 101, actions: [rollback, shrink_lr], params: {rollback: {skip_batches: 20}}}
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "policy.yaml").write_text(POLICY)
    return tmp_path


@pytest.mark.timeout(10)
def test_passing_file(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A passing test file prints a summary on stdout and returns 0."""
    path = workdir / "ok.test.yaml"
    path.write_text(PASSING)
    assert cli.test_main([str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: 1 tests passed\n"


@pytest.mark.timeout(10)
def test_failing_file_prints_diff(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A failing test prints expected against got per step, and returns 1."""
    path = workdir / "bad.test.yaml"
    path.write_text(FAILING)
    assert cli.test_main([str(path)]) == 1
    err = capsys.readouterr().err
    assert f"FAIL {path}: expects the wrong step" in err
    assert "step 100:" in err
    assert "actions: expected [rollback, shrink_lr], got []" in err
    assert f"FAIL {path}: forbids the right step" in err
    assert "steps 1-200: expected no decisions, got:" in err
    assert "step 101: rollback [nan-rollback]" in err
    assert "passes" not in err.replace("tests failed", "")
    assert f"{path}: 2 of 3 tests failed" in err


@pytest.mark.timeout(10)
def test_wrong_params_and_rule_are_reported(workdir: Path) -> None:
    """Mismatched params, rule, ranks and reason each get a line."""
    path = workdir / "p.test.yaml"
    path.write_text(
        PASSING.replace("rule: nan-rollback", "rule: other, reason_contains: 'zzz'").replace(
            "ranks: [0, 1]", "ranks: [0], params: {rollback: {steps_back: 1}}"
        )
    )
    (case,) = run_test_file(path).cases
    text = "\n".join(case.failures)
    assert "rule: expected other, got nan-rollback" in text
    assert "ranks: expected [0], got [0, 1]" in text
    assert "params of rollback: expected {'steps_back': 1}" in text
    assert "no reason contains 'zzz'" in text


@pytest.mark.timeout(10)
def test_outcome_override_and_exhaustive(workdir: Path) -> None:
    """outcomes: failed ends the chain; exhaustive flags unlisted decisions."""
    policy = POLICY.replace(
        "      - shrink_lr: {factor: 0.5}\n",
        "      - shrink_lr: {factor: 0.5}\n        on_failure: abort\n",
    )
    (workdir / "policy.yaml").write_text(policy)
    path = workdir / "o.test.yaml"
    path.write_text(
        "policy: policy.yaml\ntests:\n  - name: t\n"
        "    streams: {rank0: {nonfinite_loss: '1 _x200 1'}}\n"
        "    outcomes: [{step: 1, action: shrink_lr, outcome: failed}]\n"
        "    expect: [{step: 1, actions: [rollback, shrink_lr, abort]}]\n    exhaustive: true\n"
    )
    (case,) = run_test_file(path).cases
    assert case.failures[0] == "decisions at steps no expectation lists (exhaustive: true):"


@pytest.mark.timeout(10)
def test_stream_options(workdir: Path) -> None:
    """Rank ranges, stream mappings with severity and threshold, and start_step work."""
    (workdir / "policy.yaml").write_text(
        "version: 1\nrules:\n  - name: big\n    when: [{severity: critical}, {ratio: '> 2'}]\n"
        "    do: [notify]\n"
    )
    path = workdir / "s.test.yaml"
    path.write_text(
        "policy: policy.yaml\ntests:\n  - name: t\n    start_step: 1000\n    streams:\n"
        "      rank0-3: {loss_spike: {pattern: '_ 9.0', severity: critical, threshold: 3.0}}\n"
        "    expect: [{step: 1001, actions: [notify], ranks: [0, 1, 2, 3]}]\n"
    )
    assert run_test_file(path).passed


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (
            "policy: policy.yaml\ntests:\n  - name: t\n    streams: {rank0: {nan_loss: '1'}}\n",
            ":4:",
        ),
        ("policy: policy.yaml\ntests:\n  - name: t\n    streams: {node0: {oom: '1'}}\n", ":4:15:"),
        (
            "policy: policy.yaml\ntests:\n  - name: t\n    streams: {rank0: {oom: '1 y'}}\n",
            ":4:28:",
        ),
        ("policy: policy.yaml\ntests:\n  - name: t\n    stream: {}\n", ":4:5:"),
        ("policy: missing.yaml\ntests:\n  - name: t\n    streams: {}\n", "cannot read"),
    ],
)
@pytest.mark.timeout(10)
def test_malformed_test_file_is_located(
    workdir: Path, text: str, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mistakes in a test file are reported with a location, never a traceback."""
    path = workdir / "m.test.yaml"
    path.write_text(text)
    assert cli.test_main([str(path)]) == 1
    err = capsys.readouterr().err
    assert where in err
    assert "Traceback" not in err


BUNDLED_TESTS = sorted(
    (Path(__file__).parents[2] / "src" / "remedy" / "policies" / "tests").glob("*.test.yaml")
)


@pytest.mark.parametrize("path", BUNDLED_TESTS, ids=[p.name for p in BUNDLED_TESTS])
@pytest.mark.timeout(30)
def test_bundled_policy_tests_pass(path: Path) -> None:
    """Each bundled policy ships with a test file that passes."""
    result = run_test_file(path)
    assert result.passed, "\n".join(result.report())
    assert len(result.cases) >= 5


@pytest.mark.timeout(10)
def test_every_bundled_policy_has_tests() -> None:
    """There is one test file per bundled policy."""
    assert [p.name for p in BUNDLED_TESTS] == [
        "conservative.test.yaml",
        "default.test.yaml",
        "llm-pretrain.test.yaml",
    ]
