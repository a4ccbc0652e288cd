"""A remedy configuration error from the user's call is one located line; others are not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from remedy.protocol.exceptions import TargetError
from remedy.rank.exceptions import GuardConfigError
from remedy.rank.loop.config_error import config_error_line

TARGET = Path(__file__).resolve().parents[1] / "robustness" / "targets" / "bad_state.py"


def _load_main():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bad_state_target", TARGET)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_bad_state_is_one_line_at_the_users_guard() -> None:
    """`state={"x": object()}` fails at construction; the line names the file, line and key."""
    with pytest.raises(GuardConfigError) as info:
        _load_main()()
    line = config_error_line(info.value)
    assert line is not None and "\n" not in line
    lineno = next(
        i for i, text in enumerate(TARGET.read_text().splitlines(), 1) if "guard = Guard(" in text
    )
    assert line.startswith(f"{TARGET}:{lineno}: error: state['x']: ")
    assert line.endswith(
        "an object has no state_dict() or load_state_dict(); give an object with "
        "state_dict() and load_state_dict() (torch's Stateful protocol)"
    )


def test_other_errors_are_not_config_errors() -> None:
    """A user's own exception, and a remedy error no user line called, keep their traceback."""
    with pytest.raises(ValueError, match="positive") as info:
        raise ValueError("learning rate must be positive")
    assert config_error_line(info.value) is None
    # As the rank actor's own `load_target` raises it: no frame of the user's on its way.
    assert config_error_line(TargetError("cannot import no_such_module_here")) is None
