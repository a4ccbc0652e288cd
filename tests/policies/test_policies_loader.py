"""Loading policies: files, bundled names, text, and located errors."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from remedy.policies import (
    Diagnostic,
    PolicyError,
    bundled_policy_path,
    load_policy,
    load_policy_bytes,
    load_policy_text,
)

MINIMAL = """\
version: 1
name: minimal
rules:
  - name: nan-rollback
    when: {anomaly: nonfinite_loss}
    do:
      - rollback: {steps_back: 50, skip_batches: 20}
      - shrink_lr: {factor: 0.5, min_lr: 1.0e-6}
    cooldown_steps: 100
    max_fires: 3
"""


def _error(text: str) -> Diagnostic:
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "p.yaml")
    return info.value.diagnostics[0]


@pytest.mark.timeout(10)
def test_minimal_policy_loads_with_defaults_filled() -> None:
    """The minimal core policy loads; parameters carry their defaults."""
    policy = load_policy_text(MINIMAL)
    assert policy.name == "minimal"
    assert policy.dry_run is False
    (rule,) = policy.rules
    assert [s.action for s in rule.steps] == ["rollback", "shrink_lr"]
    assert dict(rule.steps[0].params) == {"steps_back": 50, "skip_batches": 20}
    assert rule.cooldown is not None
    assert rule.cooldown.amount == 100
    assert rule.max_fires == 3


@pytest.mark.timeout(10)
def test_policy_is_immutable() -> None:
    """Policies and their parameters cannot be changed after loading."""
    policy = load_policy_text(MINIMAL)
    with pytest.raises(AttributeError):
        policy.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        policy.rules[0].steps[0].params["steps_back"] = 1  # type: ignore[index]


@pytest.mark.timeout(10)
def test_load_from_path_sets_source_file(tmp_path: Path) -> None:
    """load_policy reads a path and records it; the name defaults to the file stem."""
    path = tmp_path / "mine.yaml"
    path.write_text(MINIMAL.replace("name: minimal\n", ""))
    policy = load_policy(path)
    assert policy.source_file == str(path)
    assert policy.name == "mine"


@pytest.mark.parametrize("name", ["default", "conservative", "llm-pretrain"])
@pytest.mark.timeout(10)
def test_bundled_policies_load_clean(name: str) -> None:
    """Every bundled policy loads by name with no lint warnings."""
    policy = load_policy(name)
    assert policy.source_file == str(bundled_policy_path(name))
    assert policy.warnings == ()


@pytest.mark.timeout(10)
def test_unknown_bundled_name_is_an_error() -> None:
    """bundled_policy_path lists the bundled names when given another."""
    with pytest.raises(PolicyError, match="bundled: default"):
        bundled_policy_path("nope")


@pytest.mark.timeout(10)
def test_missing_file_is_a_policy_error(tmp_path: Path) -> None:
    """A missing file is reported as a diagnostic, not an OSError."""
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(tmp_path / "absent.yaml")


@pytest.mark.timeout(10)
def test_malformed_yaml_gives_file_line_col() -> None:
    """A YAML syntax error is located as FILE:LINE:COL."""
    diag = _error("version: 1\nrules: [\n  {name: x\n")
    assert diag.file == "p.yaml"
    assert diag.format().startswith("p.yaml:")
    assert "YAML syntax" in diag.message


@pytest.mark.timeout(10)
def test_unknown_key_points_at_key_with_suggestion() -> None:
    """An unknown key is reported at the key itself, with a close match."""
    diag = _error(MINIMAL.replace("cooldown_steps", "cooldown_step"))
    assert (diag.line, diag.col) == (9, 5)
    assert "did you mean 'cooldown_steps'" in diag.message


@pytest.mark.timeout(10)
def test_bad_value_points_at_value_and_names_range() -> None:
    """An out-of-range number is reported at the value with the allowed range."""
    diag = _error(MINIMAL.replace("factor: 0.5", "factor: 1.5"))
    assert (diag.line, diag.col) == (8, 29)
    assert "0 < x < 1" in diag.message


@pytest.mark.timeout(10)
def test_all_errors_are_reported_together() -> None:
    """Several mistakes give several diagnostics, in file order, one line each."""
    text = MINIMAL.replace("nonfinite_loss", "nonfinite_los").replace(
        "max_fires: 3", "max_fires: 0"
    )
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "p.yaml")
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("p.yaml:5:")
    assert lines[1].startswith("p.yaml:10:")


@pytest.mark.timeout(10)
def test_policy_error_pickles() -> None:
    """PolicyError survives pickling with its diagnostics (it crosses Ray boundaries)."""
    with pytest.raises(PolicyError) as info:
        load_policy_text("version: 2\nrules: []\n", "p.yaml")
    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.diagnostics == info.value.diagnostics
    assert str(copy) == str(info.value)


@pytest.mark.timeout(10)
def test_yaml_tags_are_refused() -> None:
    """Python object tags are errors; nothing in a policy is evaluated."""
    diag = _error("version: 1\nname: !!python/object:os.system x\nrules: []\n")
    assert (diag.line, diag.col) == (2, 7)
    assert "tags are not allowed" in diag.message


@pytest.mark.timeout(10)
def test_empty_file_is_an_error() -> None:
    """An empty file says what it should start with."""
    diag = _error("")
    assert (diag.line, diag.col) == (1, 1)
    assert "version: 1" in diag.message


@pytest.mark.timeout(10)
def test_policy_pickles() -> None:
    """A loaded policy survives pickling (it may be shipped to Ray actors)."""
    policy = load_policy("llm-pretrain")
    copy = pickle.loads(pickle.dumps(policy))
    assert copy == policy
    assert copy.rule("replay-first") == policy.rule("replay-first") is not None


def test_a_text_loaded_again_is_compiled_once_and_errors_are_not_kept() -> None:
    """Loading is a pure function of (text, file name, loop) and a Policy is immutable: the
    same text loads as the same object (parsed once), bytes and a memoryview of them too;
    another file name is another policy; a text with errors is refused every time."""
    from remedy.policies import _loader  # noqa: PLC0415

    text = MINIMAL.replace("minimal", "cached-once")
    first = load_policy_text(text)
    assert load_policy_text(text) is first
    data = text.encode()
    assert load_policy_bytes(data) is load_policy_bytes(memoryview(data))
    assert load_policy_text(text, "other.yaml") is not first
    assert load_policy_text(text, "other.yaml").source_file == "other.yaml"
    kept = len(_loader._COMPILED)
    broken = text.replace("steps_back: 50", "steps_back: -1")
    for _ in range(2):
        with pytest.raises(PolicyError):
            load_policy_text(broken)
    assert len(_loader._COMPILED) == kept
    for i in range(_loader._COMPILED_MAX + 4):  # bounded: the oldest go first
        load_policy_text(text.replace("cached-once", f"p{i}"))
    assert len(_loader._COMPILED) == _loader._COMPILED_MAX
    assert load_policy_text(text) is not first  # evicted, compiled again
