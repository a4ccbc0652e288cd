"""The shape of the control code, as figures: what issue-style checks of the layout measure.

    python scripts/shape.py [SRC]   (default: src/remedy of this checkout)

Prints the largest classes (lines, methods), the `step` functions under control/, the
`Callable` names in control/, the calls into the rank side's regroup from rank/guard.py, and
the JSON-lines readers (a line a loop walks, parsed) with their files.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path


def _nodes(src: Path) -> Iterator[tuple[Path, ast.AST]]:
    """Every AST node of every module under `src`, with its file."""
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            yield path, node


def _where(src: Path, path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(src.parent)}:{getattr(node, 'lineno', 0)}"


def classes(src: Path) -> list[tuple[int, int, str]]:
    """(lines, methods, FILE:NAME) of every class under `src`, largest first."""
    out = []
    for path, node in _nodes(src):
        if isinstance(node, ast.ClassDef):
            methods = sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            out.append((lines, methods, f"{path.relative_to(src.parent)}:{node.name}"))
    return sorted(out, reverse=True)


def _called(node: ast.AST) -> str:
    """The name a call calls (`f(...)`, `x.f(...)`: "f"), else ""."""
    if not isinstance(node, ast.Call):
        return ""
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def calls_of(path: Path, name: str) -> list[int]:
    """Lines of `path` that call a function or method named `name`."""
    tree = ast.parse(path.read_text(), str(path))
    return sorted(
        n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n) == name
    )


def jsonl_readers(src: Path) -> list[str]:
    """`json.loads(LINE)` or `parse(LINE)` (rundir.jsonl's) where LINE is the variable a loop or
    comprehension walks: a reader of records line by line (one JSON file read in a loop over
    files is not one)."""
    out = set()
    for path, loop in _nodes(src):
        if isinstance(loop, ast.For):
            targets = [loop.target]
        elif isinstance(loop, ast.ListComp | ast.GeneratorExp | ast.SetComp | ast.DictComp):
            targets = [g.target for g in loop.generators]
        else:
            continue
        walked = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        for node in ast.walk(loop):
            if (
                _called(node) in ("loads", "parse")
                and isinstance(node, ast.Call)
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in walked
            ):
                out.add(_where(src, path, node))
    return sorted(out)


def callables(src: Path) -> list[str]:
    """Where a module under `src` names `Callable` (FILE:LINE)."""
    return [_where(src.parent, p, n) for p, n in _nodes(src)
            if isinstance(n, ast.Name) and n.id == "Callable"]  # fmt: skip


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "src" / "remedy"
    print("largest classes (lines, methods):")
    for lines, methods, name in classes(src)[:8]:
        print(f"  {lines:5d} {methods:3d}  {name}")
    control = list(_nodes(src / "control"))
    steps = [
        _where(src, p, n) for p, n in control if isinstance(n, ast.FunctionDef) and n.name == "step"
    ]
    print("step functions in control/:", *steps, sep="\n  ")
    print(f"Callable named in control/: {len(callables(src / 'control'))}")
    guard = src / "rank" / "guard.py"
    print(f"regroup calls in rank/guard.py: {calls_of(guard, 'regroup')}")
    print("JSON-lines readers:", *jsonl_readers(src), sep="\n  ")


if __name__ == "__main__":
    main()
