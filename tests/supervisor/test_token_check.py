"""The run's token on every call: refusals counted in the controller and journaled sparsely."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from remedy.control.run_core import RunCore
from remedy.protocol.exceptions import Unauthorized
from remedy.rundir.journals import read_journal
from remedy.rundir.writer import RunDir
from remedy.supervisor.token_check import TokenCheck
from tests.supervisor.run_cores import empty_core

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    return RunDir(tmp_path / "run", "r")


def core_of() -> RunCore:
    return empty_core("tokens", world=1, incarnation=1)


def refusals(run_dir: RunDir) -> list[int]:
    run_dir.close()
    history = read_journal(run_dir.path / "history.jsonl")
    return [r["count"] for r in history if r.get("type") == "refused"]


def test_the_runs_token_passes_and_nothing_is_counted(run_dir: RunDir) -> None:
    """The run's own token is taken: no refusal counted, none journaled."""
    core = core_of()
    check = TokenCheck(TOKEN, "r", core, run_dir)
    assert check.ok(TOKEN, "report")
    check.require(TOKEN, "status")
    assert core.controller.rejected["token"] == 0
    assert refusals(run_dir) == []


@pytest.mark.parametrize("token", [None, "", TOKEN[:-1] + "0", 7, b"bytes", "\udcff"])
def test_any_other_token_is_refused_and_counted(run_dir: RunDir, token: object) -> None:
    """A missing, wrong, non-string or unencodable token is refused and counted once."""
    core = core_of()
    assert not TokenCheck(TOKEN, "r", core, run_dir).ok(token, "report")
    assert core.controller.rejected["token"] == 1


def test_refusals_are_journaled_on_the_1st_10th_100th_of_each_call(run_dir: RunDir) -> None:
    """A flood of foreign calls journals the 1st, 10th and 100th refusal of each call only;
    every one is counted."""
    core = core_of()
    check = TokenCheck(TOKEN, "r", core, run_dir)
    for _ in range(120):
        check.ok("foreign", "report")
    check.ok("foreign", "status")
    assert core.controller.rejected["token"] == 121
    assert refusals(run_dir) == [1, 10, 100, 1]


def test_require_raises_naming_the_call_and_run(run_dir: RunDir) -> None:
    """`require` refuses with `Unauthorized`, whose message names the call and the run."""
    check = TokenCheck(TOKEN, "r", core_of(), run_dir)
    with pytest.raises(Unauthorized, match="stop refused: not run r's token"):
        check.require("foreign", "stop")


def test_a_refusal_is_counted_in_the_controllers_counter_of_now(run_dir: RunDir) -> None:
    """A restore replaces the controller's counter: refusals after it are counted in the new one."""
    core = core_of()
    check = TokenCheck(TOKEN, "r", core, run_dir)
    core.controller.rejected = Counter({"token": 5})
    check.ok(None, "report")
    assert core.controller.rejected["token"] == 6
