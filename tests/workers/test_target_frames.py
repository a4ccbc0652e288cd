"""A training function's error names the innermost frame of the user's code, not remedy's."""

from __future__ import annotations

from pathlib import Path

import pytest

from remedy.rank.loop.target import describe_exception, load_target

USER_CODE = """
from remedy.policies import load_policy

def main():
    load_policy("no-such-policy-file.yaml")  # raises inside remedy's policy loader
"""


def test_the_error_frame_is_the_users_line_under_remedys(tmp_path: Path) -> None:
    """The exception is raised in remedy's own code (src/remedy/...), called from the user's
    file: the frame named is the user's call, and remedy's frames are in the traceback only."""
    script = tmp_path / "train.py"
    script.write_text(USER_CODE)
    fn = load_target(f"{script}:main")
    with pytest.raises(Exception) as info:  # noqa: PT011 - whatever the loader raises
        fn()
    described = describe_exception(info.value)
    assert described["error_frame"] == f"{script}:5 in main"
    assert "remedy/policies" in described["traceback"]
