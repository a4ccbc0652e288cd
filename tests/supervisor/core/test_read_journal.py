"""read_journal skips a torn or damaged line and, when asked, says which (by number, from 1)."""

from __future__ import annotations

from pathlib import Path

from remedy.rundir.journals import read_journal


def test_damaged_lines_are_skipped_and_numbered(tmp_path: Path) -> None:
    """A flipped byte on line 2, a JSON list on line 4, a torn last line: three numbers, two records."""
    path = tmp_path / "journal.wal"
    path.write_text(
        '{"type": "state", "n": 1}\n{"type": "st\x01te", "n": \n\n[1, 2]\n{"type": "state", "n": 5}\n{"ty'
    )
    skipped: list[int] = []
    records = read_journal(path, skipped)
    assert [r["n"] for r in records] == [1, 5]
    assert skipped == [2, 4, 6]


def test_a_missing_journal_reads_as_empty(tmp_path: Path) -> None:
    """No file: no records, nothing skipped."""
    skipped: list[int] = []
    assert read_journal(tmp_path / "journal.wal", skipped) == [] and skipped == []
