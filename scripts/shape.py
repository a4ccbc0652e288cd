"""The shape of the control code, as figures: what issue-style checks of the layout measure.

    python scripts/shape.py [SRC]   (default: src/remedy of this checkout)

Prints the largest classes (lines, methods), the `step` functions under control/, the
`Callable` names in control/, the calls into the rank side's regroup from rank/guard.py, and
the JSON-lines readers (a `json.loads` inside a loop or comprehension) with their files.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _classes(src: Path) -> list[tuple[int, int, str]]:
    out = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                methods = sum(
                    isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body
                )
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                out.append((lines, methods, f"{path.relative_to(src.parent)}:{node.name}"))
    return sorted(out, reverse=True)


def _functions_named(src: Path, name: str) -> list[str]:
    out = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                out.append(f"{path.relative_to(src.parent)}:{node.lineno}")
    return out


def _names(src: Path, name: str) -> list[str]:
    out = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Name) and node.id == name:
                out.append(f"{path.relative_to(src.parent)}:{node.lineno}")
    return out


def calls_of(path: Path, name: str) -> list[int]:
    """Lines of `path` that call a function or method named `name`."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            called = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if called == name:
                lines.append(node.lineno)
    return sorted(lines)


def jsonl_readers(src: Path) -> list[str]:
    """`json.loads(LINE)` where LINE is the variable a loop or comprehension walks: a reader of
    records line by line (one JSON file read in a loop over files is not one)."""
    out = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for loop in ast.walk(tree):
            if isinstance(loop, ast.For):
                targets = [loop.target]
            elif isinstance(loop, ast.ListComp | ast.GeneratorExp | ast.SetComp | ast.DictComp):
                targets = [g.target for g in loop.generators]
            else:
                continue
            walked = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            for node in ast.walk(loop):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("loads", "parse")
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("json", "jsonl")
                    and node.args
                    and isinstance(node.args[0], ast.Name)
                    and node.args[0].id in walked
                ) or (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "parse"
                    and node.args
                    and isinstance(node.args[0], ast.Name)
                    and node.args[0].id in walked
                ):
                    out.append(f"{path.relative_to(src.parent)}:{node.lineno}")
    return sorted(set(out))


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "src" / "remedy"
    print("largest classes (lines, methods):")
    for lines, methods, name in _classes(src)[:8]:
        print(f"  {lines:5d} {methods:3d}  {name}")
    print("step functions in control/:", *_functions_named(src / "control", "step"), sep="\n  ")
    print(f"Callable named in control/: {len(_names(src / 'control', 'Callable'))}")
    guard = src / "rank" / "guard.py"
    print(f"regroup calls in rank/guard.py: {calls_of(guard, 'regroup')}")
    print("JSON-lines readers:", *jsonl_readers(src), sep="\n  ")


if __name__ == "__main__":
    main()
