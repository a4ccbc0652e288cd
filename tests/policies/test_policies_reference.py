"""docs/reference.md is what the code's own tables generate, so it cannot drift."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from remedy.policies import ACTIONS, ANOMALY_KINDS, SINK_KINDS
from remedy.policies._reference import (
    CALLBACKS_BEGIN,
    CALLBACKS_END,
    callbacks_markdown,
    reference_markdown,
)
from remedy.policies._vocab import ACTION_TABLE

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


def test_the_frameworks_page_holds_the_generated_callbacks_table() -> None:
    """docs/frameworks.md's table of actions under the callbacks is what the action table gives
    (regenerate it with `python -m remedy.policies reference --callbacks`)."""
    page = (REPO / "docs" / "frameworks.md").read_text()
    begin, end = page.index(CALLBACKS_BEGIN), page.index(CALLBACKS_END) + len(CALLBACKS_END)
    assert page[begin:end] + "\n" == callbacks_markdown()
    for spec in ACTION_TABLE:
        assert f"| `{spec.name}` |" in callbacks_markdown()
        if spec.under_callbacks is not None:
            assert spec.under_callbacks in callbacks_markdown()
    out = subprocess.run([sys.executable, "-m", "remedy.policies", "reference", "--callbacks"],
                         capture_output=True, text=True, check=True, timeout=60, cwd=REPO)  # fmt: skip
    assert out.stdout == callbacks_markdown()
