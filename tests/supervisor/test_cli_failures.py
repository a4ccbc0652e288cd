"""A failing training function is reported with its exception and the user's frame; its return value never kills it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remedy.cli.main import rank_errors
from remedy.cli.runner import run_supervised
from remedy.protocol.spec import RunSpec
from tests.paths import PYTHONPATH

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
TARGETS = REPO / "tests" / "robustness" / "targets"
TINY = f"{TARGETS / 'tiny.py'}:main"


def _run(tmp_path: Path, target: str, *argv: str) -> dict[str, object]:
    spec = RunSpec(target=target, run_dir=str(tmp_path / "run"), argv=list(argv))
    return run_supervised(spec)


@pytest.mark.slow
def test_target_raising_at_start_is_printed(ray_cluster: None, tmp_path: Path) -> None:
    """A function raising before its first step fails the run; its type, message and frame are printed."""
    summary = _run(tmp_path, f"{TARGETS / 'raise_at_start.py'}:main")
    assert summary["status"] == "failed"
    assert rank_errors(summary) == [
        "rank 0 failed: ValueError: learning rate must be positive, got -3",
        f"  at {TARGETS / 'raise_at_start.py'}:8 in main",
    ]


@pytest.mark.slow
def test_target_raising_later_is_printed(ray_cluster: None, tmp_path: Path) -> None:
    """A function raising at step 5 fails after 5 steps, and the user's innermost frame is named."""
    summary = _run(tmp_path, TINY, "--raise-at", "5")
    assert summary["status"] == "failed" and summary["steps_completed"] == 5
    lines = rank_errors(summary)
    assert lines[0] == "rank 0 failed: RuntimeError: loss went sideways at step 5"
    assert lines[1].startswith(f"  at {TARGETS / 'tiny.py'}:") and lines[1].endswith(" in explode")


@pytest.mark.slow
def test_target_raising_on_import_is_printed(ray_cluster: None, tmp_path: Path) -> None:
    """A module that raises while the rank imports it fails the run with that error and its line."""
    summary = _run(tmp_path, f"{TARGETS / 'raise_on_import.py'}:main")
    assert rank_errors(summary) == [
        "rank 0 failed: ImportError: this module refuses to load: CUDA toolkit 99 required",
        f"  at {TARGETS / 'raise_on_import.py'}:3 in <module>",
    ]


@pytest.mark.slow
def test_unpicklable_return_value_does_not_kill_the_rank(ray_cluster: None, tmp_path: Path) -> None:
    """A return value that cannot be pickled is replaced by its repr; the run completes."""
    summary = _run(tmp_path, TINY, "--unpicklable")
    assert summary["status"] == "completed"
    rank = summary["ranks"][0]  # type: ignore[index]
    assert "lock" in rank["result"] and isinstance(rank["result"], str)
    assert rank["result_note"].startswith("return value not picklable")
    assert summary["actions"] == {} and rank_errors(summary) == []


@pytest.mark.parametrize(("func", "status"), [("clean", "completed"), ("dirty", "failed")])
@pytest.mark.slow
def test_sys_exit_in_the_target(ray_cluster: None, tmp_path: Path, func: str, status: str) -> None:
    """`sys.exit(0)` in the training function ends it normally; `sys.exit(3)` fails it."""
    summary = _run(tmp_path, f"{TARGETS / 'sys_exit.py'}:{func}")
    assert summary["status"] == status
    if status == "failed":
        assert rank_errors(summary)[0] == "rank 0 failed: SystemExit: 3"


def _remedy(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m remedy.cli ARGV` in a process of its own, with a home of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PYTHONPATH=PYTHONPATH,
        HOME=str(tmp_path),
        REMEDY_HOME=str(tmp_path / ".remedy"),
    )
    return subprocess.run(
        [sys.executable, "-m", "remedy.cli", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
        env=env,
    )


def test_cli_prints_the_rank_exception(tmp_path: Path) -> None:
    """`remedy run` of a function that raises exits 1 and prints the exception and the user's frame."""
    proc = _remedy(tmp_path, "run", TINY, "--run-dir", str(tmp_path / "r"), "--", "--raise-at", "5")
    assert proc.returncode == 1
    assert "rank 0 failed: RuntimeError: loss went sideways at step 5" in proc.stderr
    assert f"  at {TARGETS / 'tiny.py'}:" in proc.stderr
    # Without a terminal the display writes JSON lines; the last one is the summary.
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["event"] == "summary"
    assert (last["status"], last["steps_completed"]) == ("failed", 5), last
    # The private Ray's logs of the failed run are kept in its run directory: the rank's with
    # the exception, the supervisor's, the raylet's.
    logs = tmp_path / "r" / "logs"
    kept = [f for f in json.loads((logs / "index.json").read_text())["files"] if f["kept"]]
    assert {"supervisor", "rank", "ray"} <= {f["role"] for f in kept}, kept
    rank_text = "".join((logs / f["name"]).read_text() for f in kept if f["role"] == "rank")
    assert "loss went sideways at step 5" in rank_text, rank_text[-2000:]


def test_cli_prints_a_config_error_in_one_line(tmp_path: Path) -> None:
    """`remedy run` of a loop whose Guard gets a bad `state=`: one `FILE:LINE: error:` line naming
    the key, no traceback on the terminal (it stays in the rank's log)."""
    target = TARGETS / "bad_state.py"
    proc = _remedy(tmp_path, "run", f"{target}:main", "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 1
    lineno = next(
        i for i, text in enumerate(target.read_text().splitlines(), 1) if "guard = Guard(" in text
    )
    where = f"{target}:{lineno}: error: state['x']: "
    assert f"rank 0 failed: {where}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    # The rank's own output (the JSON lines of the display) carries the one line too.
    assert where in proc.stdout, proc.stdout[-2000:]
