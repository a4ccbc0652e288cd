"""The package tree tells the architecture: real folders cut by process, imports pointing down only."""

from __future__ import annotations

import ast
from pathlib import Path

from scripts.shape import callables, calls_of, classes, jsonl_readers

SRC = Path(__file__).resolve().parents[1] / "src" / "remedy"

# Each package may import itself and the packages after it; `report` reads run directories,
# `integrations` drives the rank side, and the CLI may use both.
ORDER = ["cli", "supervisor", "rank", "rundir", "control", "protocol", "policies"]
SIDE = {
    "report": {"rundir", "control", "protocol", "policies"},
    "integrations": {"rank", "rundir", "control", "protocol", "policies"},
}


def _allowed(package: str) -> set[str]:
    if package in SIDE:
        return SIDE[package] | {package}
    below = set(ORDER[ORDER.index(package) :])
    return below | {"report", "integrations"} if package == "cli" else below


def _imports(path: Path) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
    return out


def test_the_packages_are_the_layers_and_nothing_else() -> None:
    """src/remedy holds the layer packages (and private helpers), no other folder."""
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ORDER) | set(SIDE)


def test_no_symbolic_links_under_src() -> None:
    """Real folders: a tool that follows imports sees one tree, each file under one name."""
    assert [str(p) for p in SRC.parent.rglob("*") if p.is_symlink()] == []


def test_imports_point_down_the_layers() -> None:
    """cli -> supervisor -> rank -> rundir -> control -> protocol -> policies; report -> rundir;
    integrations -> rank. An import against that order names its file and line."""
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).parts
        if len(parts) < 2:  # remedy/__init__.py and friends re-export the public names
            continue
        for line, module in _imports(path):
            names = module.split(".")
            if names[0] != "remedy" or len(names) < 2 or names[1].startswith("_"):
                continue
            if names[1] not in _allowed(parts[0]):
                upward.append(f"{path.relative_to(SRC.parent)}:{line}: {parts[0]} -> {module}")
    assert upward == []


def test_one_json_lines_reader() -> None:
    """Every JSON-lines file of a run is read by rundir/jsonl.py (its torn last line skipped, a
    damaged line located), not by a loop of its own elsewhere."""
    assert [r.split(":")[0] for r in jsonl_readers(SRC)] == ["remedy/rundir/jsonl.py"]


def test_the_guard_enters_a_regroup_from_one_place() -> None:
    """rank/guard.py calls the rank side's one regroup (`rank.group.regroup`) at one line."""
    assert len(calls_of(SRC / "rank" / "guard.py", "regroup")) == 1


def test_no_class_of_the_control_code_is_over_500_lines() -> None:
    """control/ and supervisor/ are cut along concepts: no class there grows past 500 lines,
    and the supervisor's actor module stays a shell (feeds inputs, carries effects)."""
    big = [
        f"{name}: {lines}"
        for lines, _, name in classes(SRC)
        if name.split("/")[1] in ("control", "supervisor") and lines > 500
    ]
    assert big == []
    assert len((SRC / "supervisor" / "actor.py").read_text().splitlines()) <= 500


def test_control_names_no_callable() -> None:
    """The control core is handed no callbacks: times and facts come in as inputs, what the
    shell must do leaves as effects."""
    assert callables(SRC / "control") == []
