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
from remedy.policies._diagnostics import Diagnostic
from remedy.policies._loops import LOOPS, Loop
from remedy.policies._runner import FileResult, run_test_file

_POLICY_GLOBS = ("*.yaml", "*.yml")
_TEST_GLOBS = ("*.test.yaml", "*.test.yml")
LOOP_HELP = (
    "the loop the policy runs under: guard (default; every action) or callbacks (the Hugging "
    "Face and Lightning callbacks: an action they cannot carry out is an error)"
)


def check_main(paths: list[str], *, strict: bool, loop: Loop = "guard") -> int:
    """Check policy files (a folder means its *.yaml and *.yml files, test files aside);
    print diagnostics; return 0 if every file is clean, 1 otherwise.

    `loop`: the loop the files are meant for; under `callbacks` a step of an action
    the framework callbacks cannot carry out is an error saying why.

    Every file is checked whatever the others hold; a folder with nothing to
    check is an error.
    """
    status = 0
    for path in _expand(paths, _POLICY_GLOBS, exclude=_TEST_GLOBS):
        if isinstance(path, _Empty):
            print(path.message("policy files (*.yaml, *.yml)"), file=sys.stderr)
            status = 1
            continue
        try:
            found = check_policy(path, strict=strict, loop=loop)
        except Exception as exc:  # a bug of ours must not stop the other files
            found = [Diagnostic(path, 1, 1, f"internal error: {type(exc).__name__}: {exc}")]
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
    """Run policy test files (a folder means its *.test.yaml and *.test.yml files); return 0
    if every test passed. A folder with no test files is an error."""
    status = 0
    for path in _expand(paths, _TEST_GLOBS):
        if isinstance(path, _Empty):
            print(path.message("policy test files (*.test.yaml, *.test.yml)"), file=sys.stderr)
            status = 1
            continue
        try:
            result = run_test_file(path)
        except Exception as exc:  # a bug of ours must not stop the other files
            result = FileResult(path)
            result.errors.append(
                Diagnostic(path, 1, 1, f"internal error: {type(exc).__name__}: {exc}")
            )
        lines = result.report()
        stream = sys.stdout if result.passed else sys.stderr
        for line in lines:
            print(line, file=stream)
        if not result.passed:
            status = 1
    return status


class _Empty:
    """A folder in which nothing matched."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def message(self, what: str) -> str:
        return f"{self.folder}: error: no {what} in this folder; nothing was checked"


def _expand(
    paths: list[str], patterns: tuple[str, ...], *, exclude: tuple[str, ...] = ()
) -> list[str | _Empty]:
    """Paths as given, with each folder replaced by its matching files in name order."""
    out: list[str | _Empty] = []
    for path in paths:
        folder = Path(path)
        if not folder.is_dir():
            out.append(path)
            continue
        found = {
            p
            for pattern in patterns
            for p in folder.glob(pattern)
            if p.is_file() and not any(p.match(x) for x in exclude)
        }
        out.extend(sorted(str(p) for p in found) or [_Empty(path)])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m remedy.policies check [--strict] FILE...` / `python -m remedy.policies test FILE...`."""
    parser = argparse.ArgumentParser(prog="python -m remedy.policies", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate and lint policy files")
    check.add_argument("--strict", action="store_true", help="treat warnings as errors")
    check.add_argument("--loop", choices=LOOPS, default="guard", help=LOOP_HELP)
    check.add_argument("paths", nargs="+", metavar="FILE")
    run = sub.add_parser("test", help="run policy test files")
    run.add_argument("paths", nargs="+", metavar="FILE")
    ref = sub.add_parser("reference", help="print the policy reference page (docs/reference.md)")
    ref.add_argument(
        "--callbacks",
        action="store_true",
        help="print the table of actions under the framework callbacks (docs/frameworks.md)",
    )
    args = parser.parse_args(argv)
    if args.command == "reference":
        from remedy.policies._reference import (  # noqa: PLC0415 - rarely used
            callbacks_markdown,
            reference_markdown,
        )

        sys.stdout.write(callbacks_markdown() if args.callbacks else reference_markdown())
        return 0
    if args.command == "check":
        return check_main(args.paths, strict=args.strict, loop=args.loop)
    return test_main(args.paths)


# Not a pytest test, despite the name the CLI contract gives it.
test_main.__test__ = False  # type: ignore[attr-defined]
