"""`--check-imports`: the smoke mode of every benchmark the README and docs name.

A benchmark's module-level imports run when it starts, but many import Ray,
Ray Train, the supervisor or a framework only inside the function that needs
them, and load a training script (a target) only in the ranks it starts. So a
dependency the setup does not install (`ray[train]` for `goodput.py`, say)
would surface minutes into a run, or never in CI. With `--check-imports` a
benchmark parses its arguments, imports what those functions import, loads
the targets it runs and finds the modules it runs with `python -m`, prints
one line, and exits 0; any missing piece is an error at once.
tests/test_benchmarks_smoke.py runs every named benchmark so.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_check_imports(parser: argparse.ArgumentParser) -> None:
    """The `--check-imports` flag, the same on every benchmark."""
    parser.add_argument(
        "--check-imports",
        action="store_true",
        help="import everything this benchmark needs, parse the arguments, and exit (a smoke run)",
    )


def check_imports(
    *modules: str, targets: tuple[str, ...] = (), run_modules: tuple[str, ...] = ()
) -> None:
    """Import `modules`, load each `path.py:function` target (paths from the repository root),
    and find each module run as `python -m NAME`; then print one line.

    Raises what the import raises (ImportError, ModuleNotFoundError) where a piece is missing.
    """
    for name in modules:
        importlib.import_module(name)
    if targets:
        from remedy.rank.loop.target import load_target  # noqa: PLC0415 - only with targets

        for target in targets:
            where, _, func = target.rpartition(":")
            path = Path(where) if Path(where).is_absolute() else ROOT / where
            load_target(f"{path}:{func}")
    for name in run_modules:
        runnable = name if name.endswith("__main__") else f"{name}.__main__"
        if importlib.util.find_spec(runnable) is None:
            raise ModuleNotFoundError(f"`python -m {name}` cannot run: no module {runnable}")
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "benchmark"
    print(
        f"imports ok: {script} ({len(modules)} modules, {len(targets)} targets, "
        f"{len(run_modules)} runnable modules)"
    )
