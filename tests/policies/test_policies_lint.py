"""Semantic lints: shadowed rules, short cooldowns, cycles, and strict mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.policies import check_policy, cli, load_policy_text


def _warnings(text: str) -> list[str]:
    return [d.format() for d in load_policy_text(text, "p.yaml").warnings]


SHADOWED = """\
version: 1
rules:
  - name: any-spike
    when: {anomaly: [loss_spike, loss_divergence]}
    do: [notify]
  - name: big-spike
    when: [{anomaly: loss_spike}, {value: "> 10"}]
    do: [rollback]
"""


@pytest.mark.timeout(10)
def test_shadowed_rule_is_reported_at_its_name() -> None:
    """A rule whose events an earlier, broader rule always claims is reported."""
    (warning,) = _warnings(SHADOWED)
    assert warning.startswith("p.yaml:6:11: warning: rule 'big-spike' can never fire")
    assert "'any-spike' (line 3)" in warning


@pytest.mark.timeout(10)
def test_continue_or_count_avoids_shadowing() -> None:
    """continue: true, or a count on the earlier rule, means no shadowing."""
    with_continue = SHADOWED.replace("    do: [notify]\n", "    do: [notify]\n    continue: true\n")
    assert _warnings(with_continue) == []
    counting = SHADOWED.replace(
        "    do: [notify]\n", "    do: [notify]\n    count: 2\n    within: 9\n"
    )
    assert _warnings(counting) == []


@pytest.mark.timeout(10)
def test_narrower_earlier_rule_does_not_shadow() -> None:
    """An earlier, narrower rule leaves room for the later one."""
    swapped = SHADOWED.replace("any-spike", "tmp").replace("big-spike", "any-spike")
    text = (
        "version: 1\nrules:\n"
        '  - name: big\n    when: [{anomaly: loss_spike}, {value: "> 10"}]\n    do: [rollback]\n'
        "  - name: any\n    when: {anomaly: loss_spike}\n    do: [notify]\n"
    )
    assert _warnings(text) == []
    assert swapped


@pytest.mark.timeout(10)
def test_cooldown_shorter_than_window() -> None:
    """A cooldown shorter than the rule's own window is reported at the cooldown."""
    text = (
        "version: 1\nrules:\n  - name: r\n    when: {anomaly: loss_spike}\n"
        "    count: 3\n    within: 100\n    cooldown_steps: 10\n    do: [rollback]\n"
    )
    (warning,) = _warnings(text)
    assert warning.startswith("p.yaml:7:21: warning: cooldown (10 steps) is shorter")


@pytest.mark.timeout(10)
def test_escalation_cycle() -> None:
    """Rules escalating to each other in a loop are reported once."""
    text = (
        "version: 1\nrules:\n"
        "  - name: a\n    when: {anomaly: oom}\n    do: [notify]\n    max_fires: 1\n"
        "    on_exhausted: {rule: b}\n"
        "  - name: b\n    when: {anomaly: oom}\n    do: [notify]\n    max_fires: 1\n"
        "    on_exhausted: {rule: a}\n"
    )
    warnings = _warnings(text)
    assert len(warnings) == 1
    assert "escalation cycle: a -> b -> a" in warnings[0]


@pytest.mark.timeout(10)
def test_on_failure_next_on_last_step_and_on_exhausted_without_max_fires() -> None:
    """Two settings that do nothing are reported."""
    text = (
        "version: 1\nrules:\n  - name: r\n    when: {anomaly: oom}\n"
        "    on_exhausted: notify\n    do:\n      - notify:\n        on_failure: next\n"
    )
    warnings = _warnings(text)
    assert any("on_failure: next on the last step" in w for w in warnings)
    assert any("on_exhausted has no effect without max_fires" in w for w in warnings)


@pytest.mark.timeout(10)
def test_strict_turns_warnings_into_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """check --strict fails on warnings; without it the file is ok with warnings."""
    path = tmp_path / "shadow.yaml"
    path.write_text(SHADOWED)
    assert [d.severity for d in check_policy(path)] == ["warning"]
    assert [d.severity for d in check_policy(path, strict=True)] == ["error"]
    assert cli.check_main([str(path)], strict=False) == 0
    assert "ok (1 warnings)" in capsys.readouterr().out
    assert cli.check_main([str(path)], strict=True) == 1
    assert f"{path}:6:11: error: rule 'big-spike'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["default", "conservative", "llm-pretrain"])
@pytest.mark.timeout(10)
def test_bundled_policies_pass_strict(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The bundled policies are clean even under --strict."""
    assert cli.check_main([name], strict=True) == 0
    assert capsys.readouterr().out == f"{name}: ok\n"
