"""Command-line entry points: `check_main` and `test_main`.

The supervisor's CLI wires them as `remedy policy check` and
`remedy policy test`; `python -m remedy.policies check|test FILE...` runs them
without it. Diagnostics and failures go to stderr, progress to stdout.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from remedy.policies._check import check_policy
from remedy.policies._runner import run_test_file


def check_main(paths: list[str], *, strict: bool) -> int:
    """Check policy files (a folder means its *.yaml files); print diagnostics; return 0 if clean."""
    status = 0
    for path in _expand(paths, "*.yaml"):
        found = check_policy(path, strict=strict)
        for diag in found:
            print(diag.format(), file=sys.stderr)
        if any(d.severity == "error" for d in found):
            status = 1
        elif not found:
            print(f"{path}: ok")
        else:
            print(f"{path}: ok ({len(found)} warnings)")
    return status


def test_main(paths: list[str]) -> int:
    """Run policy test files (a folder means its *.test.yaml files); return 0 if every test passed."""
    status = 0
    for path in _expand(paths, "*.test.yaml"):
        result = run_test_file(path)
        lines = result.report()
        stream = sys.stdout if result.passed else sys.stderr
        for line in lines:
            print(line, file=stream)
        if not result.passed:
            status = 1
    return status


def _expand(paths: list[str], pattern: str) -> list[str]:
    """Paths as given, with each folder replaced by its matching files in name order."""
    out: list[str] = []
    for path in paths:
        folder = Path(path)
        out.extend(sorted(str(p) for p in folder.glob(pattern)) if folder.is_dir() else [path])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m remedy.policies check [--strict] FILE...` / `python -m remedy.policies test FILE...`."""
    parser = argparse.ArgumentParser(prog="python -m remedy.policies", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate and lint policy files")
    check.add_argument("--strict", action="store_true", help="treat warnings as errors")
    check.add_argument("paths", nargs="+", metavar="FILE")
    run = sub.add_parser("test", help="run policy test files")
    run.add_argument("paths", nargs="+", metavar="FILE")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check_main(args.paths, strict=args.strict)
    return test_main(args.paths)


# Not a pytest test, despite the name the CLI contract gives it.
test_main.__test__ = False  # type: ignore[attr-defined]
