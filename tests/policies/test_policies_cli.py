"""`python -m remedy.policies check|test`, end to end in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remedy.policies", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


@pytest.mark.timeout(90)
def test_check_ok_and_broken() -> None:
    """check prints FILE: ok for good files and located errors for bad ones."""
    proc = _run("check", "default", "tests/policies/broken/unknown_action.yaml")
    assert proc.returncode == 1
    assert "default: ok" in proc.stdout
    assert "tests/policies/broken/unknown_action.yaml:7:9: error: unknown action" in proc.stderr


@pytest.mark.timeout(90)
def test_test_bundled_files() -> None:
    """test runs the bundled policy tests and exits 0."""
    proc = _run(
        "test",
        *sorted(str(p) for p in (ROOT / "src" / "remedy" / "policies" / "tests").glob("*.yaml")),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("tests passed") == 3


@pytest.mark.timeout(90)
def test_usage_error() -> None:
    """No subcommand is a usage error (exit 2)."""
    assert _run().returncode == 2


@pytest.mark.timeout(90)
def test_package_imports_neither_ray_nor_torch() -> None:
    """Importing the policy package and running it pulls in no Ray or torch."""
    code = (
        "import sys, remedy.policies.testing, remedy.policies.cli\n"
        "remedy.policies.testing.run_stream('default', remedy.policies.testing.stream('oom', '1'))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "[]"
