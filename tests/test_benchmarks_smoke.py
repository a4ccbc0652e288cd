"""Every benchmark the README and docs name starts on this setup: its smoke mode imports all it needs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# A benchmark's smoke mode where it is not `--check-imports` (benchmarks/_smoke.py).
MODES = {"gpu_check.py": "--dry-run"}
# One interpreter runs them all (importing torch, Ray, transformers and Lightning once, not once
# per benchmark); each runs as `python benchmarks/X.py MODE` would, its exit status and any
# exception printed on one line. The GPU check goes first: its dry run fails if Ray is already
# imported, which the others do.
DRIVER = """
import runpy, sys, traceback
for path, mode in [tuple(a.split("=", 1)) for a in sys.argv[1:]]:
    sys.argv = [path, mode]
    sys.path.insert(0, path.rsplit("/", 1)[0])
    try:
        runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    except BaseException as exc:
        code = f"{type(exc).__name__}: {exc}".splitlines()[0]
    print(f"SMOKE {path.rsplit('/', 1)[1]} -> {code}", flush=True)
"""


def named_benchmarks() -> list[str]:
    """The `benchmarks/*.py` files that README.md or a page under docs/ names."""
    texts = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    names = set()
    for path in texts:
        names.update(re.findall(r"benchmarks/([a-z_]+\.py)", path.read_text()))
    return sorted(names, key=lambda n: (n != "gpu_check.py", n))


def smoke_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def test_every_named_benchmark_exists_and_has_a_smoke_mode() -> None:
    """Each benchmark a page names is a file here whose arguments include its smoke mode."""
    names = named_benchmarks()
    assert "goodput.py" in names and "overhead.py" in names and "gpu_check.py" in names
    for name in names:
        path = REPO / "benchmarks" / name
        assert path.is_file(), f"the docs name benchmarks/{name}, which does not exist"
        mode = MODES.get(name, "--check-imports")
        assert f'"{mode}"' in path.read_text() or "add_check_imports(" in path.read_text(), name


@pytest.mark.timeout(300)
def test_every_named_benchmark_imports_what_it_needs() -> None:
    """Each named benchmark, run in its smoke mode, exits 0: a dependency the setup does not
    install (Ray Train for goodput.py, a framework for a target) fails here, not in a long run."""
    names = named_benchmarks()
    pairs = [f"benchmarks/{n}={MODES.get(n, '--check-imports')}" for n in names]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *pairs],
        check=False,
        capture_output=True,
        text=True,
        timeout=290,
        env=smoke_env(),
        cwd=REPO,
    )
    results = dict(
        line.removeprefix("SMOKE ").split(" -> ", 1)
        for line in proc.stdout.splitlines()
        if line.startswith("SMOKE ")
    )
    failed = {n: code for n, code in results.items() if code != "0"}
    assert sorted(results) == sorted(names), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not failed, f"{failed}\n{proc.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", named_benchmarks())
def test_each_named_benchmark_starts_alone(name: str) -> None:
    """The same, one fresh interpreter per benchmark, as a user starts it."""
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{name}", MODES.get(name, "--check-imports")],
        check=False,
        capture_output=True,
        text=True,
        timeout=110,
        env=smoke_env(),
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
