"""A run directory that cannot be written (full, read-only, deleted) ends the run in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from remedy.cli.main import EXIT_RUN_DIR, EXIT_USAGE
from tests.paths import PYTHONPATH

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TINY = f"{REPO / 'tests' / 'robustness' / 'targets' / 'tiny.py'}:main"
# Left free on the 1 MB run directory's disk: the run's journals fill it within seconds.
FREE = 96 * 1024


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        PYTHONPATH=PYTHONPATH,
        HOME=str(tmp / "home"),
        REMEDY_HOME=str(tmp / "home" / ".remedy"),
        REMEDY_FALLBACK_DIR=str(tmp / "fallback"),
    )
    return env


def _remedy(tmp: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "remedy.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp),
    )


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs, filled but for `FREE` bytes; unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 1 MB tmpfs here: {mounted.stderr.strip()}")
    try:
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * max(free - FREE, 0))
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("remedy:")]
    assert "internal error" not in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert len(errors) == 1, stderr
    return errors[0]


def test_a_full_run_directory_ends_the_run_in_one_line(small_disk: Path, tmp_path: Path) -> None:
    """ENOSPC on the supervisor's own files: one line naming the file and ENOSPC, exit
    EXIT_RUN_DIR, the summary (failed) in the fallback directory it names."""
    run_dir = small_disk / "run"
    proc = _remedy(tmp_path, "run", TINY, "--run-dir", str(run_dir), "--quiet",
                   "--", "--steps", "20000")  # fmt: skip
    _, stderr = proc.communicate(timeout=240)
    line = _one_error_line(stderr)
    assert proc.returncode == EXIT_RUN_DIR, stderr
    assert line.startswith(f"remedy: error: {run_dir}/"), line
    assert "No space left on device (ENOSPC)" in line, line
    summary_file = Path(line.rsplit("summary in ", 1)[1])
    assert summary_file.parent.parent == tmp_path / "fallback", line
    summary = json.loads(summary_file.read_text())
    assert summary["status"] == "failed" and "ENOSPC" in summary["io_error"]


@pytest.mark.slow
def test_a_run_directory_deleted_mid_run_ends_the_run_in_one_line(tmp_path: Path) -> None:
    """The run directory removed while the run goes on: one line saying so, exit EXIT_RUN_DIR."""
    run_dir = tmp_path / "run"
    proc = _remedy(tmp_path, "run", TINY, "--run-dir", str(run_dir), "--quiet",
                   "--", "--steps", "100000", "--sleep", "0.01")  # fmt: skip
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    shutil.rmtree(run_dir)
    _, stderr = proc.communicate(timeout=180)
    line = _one_error_line(stderr)
    assert proc.returncode == EXIT_RUN_DIR, stderr
    assert line.startswith(f"remedy: error: {run_dir}: the run directory was deleted (ENOENT)"), (
        line
    )
    assert json.loads(Path(line.rsplit("summary in ", 1)[1]).read_text())["status"] == "failed"


def test_a_read_only_run_directory_is_one_line_before_anything_runs(
    small_disk: Path, tmp_path: Path
) -> None:
    """A run directory on a read-only disk: one usage line naming it and EROFS's words, exit 2."""
    remount = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    if remount.returncode != 0:
        pytest.skip(f"cannot remount read-only here: {remount.stderr.strip()}")
    run_dir = small_disk / "run"
    proc = _remedy(tmp_path, "run", TINY, "--run-dir", str(run_dir), "--", "--steps", "5")
    _, stderr = proc.communicate(timeout=120)
    line = _one_error_line(stderr)
    assert proc.returncode == EXIT_USAGE, stderr
    assert str(run_dir) in line and "Read-only file system" in line, line
