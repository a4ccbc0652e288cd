"""Broken policy files: each mistake is reported at its exact line and column."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from remedy.policies import PolicyError, check_policy, cli, load_policy

BROKEN = sorted((Path(__file__).parent / "broken").glob("*.yaml"))
_HEADER = re.compile(r"# error: (\d+):(\d+): (.*)")


def _expected(path: Path) -> tuple[int, int, str]:
    match = _HEADER.fullmatch(path.read_text().splitlines()[0])
    assert match is not None, f"{path.name} needs a '# error: LINE:COL: message' first line"
    return int(match[1]), int(match[2]), match[3]


@pytest.mark.timeout(10)
def test_there_are_enough_broken_files() -> None:
    """The broken-policy corpus covers at least 15 distinct mistakes."""
    assert len(BROKEN) >= 15
    assert len({_expected(p)[2] for p in BROKEN}) == len(BROKEN)


@pytest.mark.parametrize("path", BROKEN, ids=[p.stem for p in BROKEN])
@pytest.mark.timeout(10)
def test_error_is_located_exactly(path: Path) -> None:
    """load_policy raises one error for the file's one mistake, at the expected line:col."""
    line, col, message = _expected(path)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    first = info.value.diagnostics[0]
    assert (first.line, first.col) == (line, col), first.format()
    assert message in first.message
    assert first.file == str(path)
    assert str(info.value).splitlines()[0] == first.format()


@pytest.mark.parametrize("path", BROKEN, ids=[p.stem for p in BROKEN])
@pytest.mark.timeout(10)
def test_check_main_prints_location(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """check_main prints FILE:LINE:COL: error: ... to stderr and returns 1."""
    line, col, message = _expected(path)
    assert cli.check_main([str(path)], strict=False) == 1
    err = capsys.readouterr().err
    assert f"{path}:{line}:{col}: error: " in err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.timeout(10)
def test_check_policy_matches_load_errors() -> None:
    """check_policy returns the same located errors that load_policy raises."""
    for path in BROKEN:
        with pytest.raises(PolicyError) as info:
            load_policy(path)
        errors = [d for d in check_policy(path) if d.severity == "error"]
        assert errors == info.value.diagnostics
