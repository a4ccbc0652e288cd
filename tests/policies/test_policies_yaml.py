"""Safe YAML loading with positions."""

from __future__ import annotations

import pytest

from remedy.policies import PolicyError
from remedy.policies._yaml import load_yaml


@pytest.mark.timeout(10)
def test_positions_of_keys_and_values() -> None:
    """Keys and values get 1-based line and column; list items too."""
    doc = load_yaml("a: 1\nb:\n  - x\n  - {c: 2}\n", "f.yaml")
    assert doc.data == {"a": 1, "b": ["x", {"c": 2}]}
    assert doc.key_pos[("a",)] == (1, 1)
    assert doc.value_pos[("a",)] == (1, 4)
    assert doc.value_pos[("b", 1)] == (4, 5)
    assert doc.value_pos[("b", 1, "c")] == (4, 9)


@pytest.mark.timeout(10)
def test_locate_falls_back_to_nearest_ancestor() -> None:
    """A path that does not exist is located at its deepest existing parent."""
    doc = load_yaml("a:\n  b: 1\n", "f.yaml")
    assert doc.locate(("a", "missing", 3)) == (2, 3)
    assert doc.locate(("nothing",)) == (1, 1)


@pytest.mark.timeout(10)
def test_anchors_and_merge_keys_are_plain_data() -> None:
    """Anchors, aliases and << merges load as plain values."""
    doc = load_yaml("base: &b {x: 1}\nuse:\n  <<: *b\n  y: 2\n", "f.yaml")
    assert doc.data["use"] == {"x": 1, "y": 2}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: 2024-01-01\n", "dates are not allowed"),
        ("a: !custom 1\n", "YAML tags are not allowed"),
        ("? [1, 2]\n: x\n", "mapping keys must be strings"),
        ("a: 1\na: 2\n", 'duplicate key "a"'),
    ],
)
@pytest.mark.timeout(10)
def test_refused_yaml(text: str, message: str) -> None:
    """Non-JSON values, tags, complex keys and duplicates are located errors."""
    with pytest.raises(PolicyError, match=message) as info:
        load_yaml(text, "f.yaml")
    assert info.value.diagnostics[0].file == "f.yaml"


@pytest.mark.timeout(10)
def test_str_tag_is_allowed() -> None:
    """The core !!str tag is fine: it only makes a string."""
    assert load_yaml("a: !!str 5\n", "f.yaml").data == {"a": "5"}
