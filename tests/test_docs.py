"""README.md is a manual and docs/ describes the code, not the days it was measured.

The README stays short, holds the default policy's table as the policy generates it,
and links to pages and sections that exist; no page carries a dated run or a run's
history, except docs/benchmarks.md, whose rows each name a figure's command and the
date of its run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from scripts.policy_table import BEGIN, END, main, policy_table, readme_with_table
from tests.paths import PYTHONPATH

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
BENCHMARKS = DOCS / "benchmarks.md"
MAX_README_LINES = 300
# The check: a date, or the words of a diary that orders runs by day.
DIARY = re.compile(
    r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|(earlier|later) that day|the day before|the run before"
)
DATE_COLUMN = "date of the run"
BENCHMARK_COLUMNS = ["figure", "value", "command", "machine", "load", DATE_COLUMN]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _slug(heading: str) -> str:
    """The anchor mkdocs' toc gives a heading (lower case, punctuation dropped, spaces to -)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", page.read_text(), re.M)}


def test_the_readme_is_at_most_300_lines() -> None:
    """README.md is a manual of at most 300 lines (details go to the pages under docs/)."""
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_no_page_outside_benchmarks_carries_a_dated_run() -> None:
    """Neither README.md nor a page under docs/ other than benchmarks.md has a date or a diary."""
    found = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        if page == BENCHMARKS:
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if DIARY.search(line):
                found.append(f"{page.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "dated runs belong in docs/benchmarks.md:\n" + "\n".join(found)


def test_benchmarks_has_dates_only_in_its_date_column() -> None:
    """In benchmarks.md a date appears only in the `date of the run` cell of a figure's row."""
    header: list[str] | None = None
    stray = []
    for n, line in enumerate(BENCHMARKS.read_text().splitlines(), 1):
        is_row = line.startswith("|")
        if not is_row:
            header = None
        elif header is None:
            header = _cells(line)
            continue
        if not DIARY.search(line):
            continue
        cells = _cells(line) if is_row else []
        date_at = header.index(DATE_COLUMN) if header and DATE_COLUMN in header else None
        outside = [c for i, c in enumerate(cells) if i != date_at and DIARY.search(c)]
        if date_at is None or outside or not is_row:
            stray.append(f"docs/benchmarks.md:{n}: {line.strip()}")
    assert not stray, "a date outside the `date of the run` column:\n" + "\n".join(stray)


def test_every_benchmark_row_names_its_command_and_date() -> None:
    """Every table of benchmarks.md has the six columns, and every row a command and a date."""
    lines = BENCHMARKS.read_text().splitlines()
    tables = 0
    for n, line in enumerate(lines, 1):
        if not line.startswith("|") or (n > 1 and lines[n - 2].startswith("|")):
            continue
        tables += 1
        assert _cells(line) == BENCHMARK_COLUMNS, f"docs/benchmarks.md:{n}: columns {_cells(line)}"
        for m, row in enumerate(lines[n + 1 :], n + 2):
            if not row.startswith("|"):
                break
            cells = _cells(row)
            assert len(cells) == len(BENCHMARK_COLUMNS), (
                f"docs/benchmarks.md:{m}: {len(cells)} cells"
            )
            assert re.search(r"`[^`]+`", cells[2]), f"docs/benchmarks.md:{m}: no command"
            assert re.fullmatch(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}", cells[5]), (
                f"docs/benchmarks.md:{m}: the date of the run is {cells[5]!r}"
            )
    assert tables > 0


def test_the_readme_policy_table_is_the_generated_one() -> None:
    """README.md's table of the default policy is what scripts/policy_table.py generates."""
    text = README.read_text()
    assert BEGIN in text and END in text
    assert readme_with_table(text) == text, (
        "README.md's policy table is stale: run `python scripts/policy_table.py --write`"
    )


def test_the_policy_table_has_a_row_per_rule() -> None:
    """Every rule of the default policy has its row, named, with its first action."""
    table = policy_table()
    for rule, action in [("nan-rollback", "rollback"), ("oom-relief", "enable_activation_checkpointing"),
                         ("rank-restart", "restart_rank"), ("notify-rest", "notify")]:  # fmt: skip
        row = next(line for line in table.splitlines() if f"| `{rule}` |" in line)
        assert f"`{action}`" in row


def _check(readme: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    return subprocess.run([sys.executable, "scripts/policy_table.py", "--check", "--readme", str(readme)],
                          check=False, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_policy_table_check_fails_on_a_stale_readme(tmp_path: Path) -> None:
    """`--check` passes the committed README and fails, saying what to run, on a stale copy."""
    assert main(["--check"]) == 0
    stale = tmp_path / "README.md"
    stale.write_text(README.read_text().replace("`nan-rollback`", "`nan-rollback-old`"))
    out = _check(stale)
    assert out.returncode == 1
    assert "python scripts/policy_table.py --write" in out.stderr


def test_the_readme_setup_command_is_the_ci_one() -> None:
    """The README's setup command is the one .ci/run runs, word for word."""
    ci = (REPO / ".ci" / "run").read_text()
    setup = re.search(r"bounded setup (python -m pip install .+)", ci)
    assert setup is not None
    assert f"\n{setup.group(1)}\n" in README.read_text()


def test_the_readme_links_to_pages_and_sections_that_exist() -> None:
    """Every docs/ link in README.md names a page that exists and, with #, one of its headings."""
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", README.read_text())
    assert links
    for page, anchor in links:
        path = REPO / page
        assert path.exists(), f"README.md links to {page}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"README.md links to {page}#{anchor}: no such heading"
