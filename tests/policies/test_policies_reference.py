"""docs/reference.md is what the code's own tables generate, so it cannot drift."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from remedy.policies import ACTIONS, ANOMALY_KINDS, SINK_KINDS
from remedy.policies._reference import reference_markdown

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "reference.md"


def test_the_reference_page_is_the_generated_one() -> None:
    """The committed page equals the generator's output (regenerate it when this fails)."""
    assert PAGE.read_text() == reference_markdown(), (
        "docs/reference.md is stale: run `python -m remedy.policies reference > docs/reference.md`"
    )


def test_the_page_names_every_action_kind_and_sink() -> None:
    """Every action (with its parameters), anomaly kind and notify sink is on the page."""
    text = reference_markdown()
    assert all(f"| `{a}` |" in text for a in ACTIONS)
    assert all(f"- `{k}`" in text for k in ANOMALY_KINDS)
    assert all(f"`{s}`" in text for s in SINK_KINDS)
    assert "`steps_back` (`100`)" in text and "`count` (required)" in text


def test_the_cli_prints_it() -> None:
    """`python -m remedy.policies reference` prints the page."""
    out = subprocess.run([sys.executable, "-m", "remedy.policies", "reference"], capture_output=True,
                         text=True, check=True, timeout=60, cwd=REPO)  # fmt: skip
    assert out.stdout == reference_markdown()
