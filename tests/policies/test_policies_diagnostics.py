"""Diagnostics: formatting, ordering, promotion."""

from __future__ import annotations

import pytest

from remedy.policies import Diagnostic
from remedy.policies._diagnostics import sort_key


@pytest.mark.timeout(10)
def test_format() -> None:
    """format() is FILE:LINE:COL: severity: message."""
    assert Diagnostic("p.yaml", 3, 7, "bad").format() == "p.yaml:3:7: error: bad"
    assert Diagnostic("p.yaml", 1, 1, "hm", "warning").format() == "p.yaml:1:1: warning: hm"


@pytest.mark.timeout(10)
def test_as_error_and_sorting() -> None:
    """Warnings promote to errors; diagnostics sort by place."""
    late = Diagnostic("p.yaml", 9, 1, "b", "warning")
    early = Diagnostic("p.yaml", 2, 5, "a")
    assert late.as_error().severity == "error"
    assert sorted([late, early], key=sort_key) == [early, late]
