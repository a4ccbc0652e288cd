"""The one JSON-lines reader: a torn last line is skipped, a damaged middle one is named by FILE:LINE:COL."""

from __future__ import annotations

import json
import pickle
from datetime import datetime
from pathlib import Path

import pytest

from remedy.rundir import jsonl
from remedy.rundir.journals import last_written, read_journal
from remedy.rundir.jsonl import Damaged, JsonlError, read_jsonl
from remedy.rundir.ray_logs import wants_logs
from remedy.rundir.read import RunFiles, read_records

QUOTES = "Expecting property name enclosed in double quotes"


def _lines(*records: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.fixture
def torn(tmp_path: Path) -> Path:
    """Two whole lines, then a third cut short by a crash mid-write (no newline)."""
    path = tmp_path / "journal.wal"
    path.write_text(_lines({"n": 1}, {"n": 2}) + '{"n": 3, "ts"')
    return path


@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    """A blank line, a damaged middle line (line 3), a JSON list (line 4), then a whole one."""
    path = tmp_path / "decisions.jsonl"
    path.write_text(_lines({"n": 1}) + "\n" + '{"n": 2,, }\n' + "[1, 2]\n" + _lines({"n": 5}))
    return path


def test_a_torn_last_line_is_skipped_by_every_read(torn: Path) -> None:
    """The whole lines are read; the torn one is handed back as torn, and a strict read does not raise."""
    found: list[Damaged] = []
    assert list(jsonl.records(torn, damaged=found)) == [{"n": 1}, {"n": 2}]
    assert [(d.line, d.torn) for d in found] == [(3, True)]
    assert read_jsonl(torn) == [{"n": 1}, {"n": 2}]


def test_a_damaged_middle_line_is_located_and_a_strict_read_raises_on_it(damaged: Path) -> None:
    """Line 3 is not JSON: FILE:3:COL: error:, with the column where the parser stopped."""
    found: list[Damaged] = []
    assert list(jsonl.records(damaged, damaged=found)) == [{"n": 1}, {"n": 5}]
    assert [str(d) for d in found] == [
        f"{damaged}:3:9: error: not JSON ({QUOTES})",
        f"{damaged}:4:1: error: a JSON list, not an object",
    ]
    assert not any(d.torn for d in found)
    with pytest.raises(JsonlError, match=rf"^{damaged}:3:9: error: not JSON") as raised:
        read_jsonl(damaged)
    assert str(pickle.loads(pickle.dumps(raised.value))) == str(raised.value)


def test_a_missing_file_reads_as_empty(tmp_path: Path) -> None:
    """No file, no records, nothing damaged."""
    found: list[Damaged] = []
    assert list(jsonl.records(tmp_path / "none.jsonl", damaged=found)) == []
    assert read_jsonl(tmp_path / "none.jsonl") == [] and found == []


def test_the_journal_reader_counts_damaged_and_torn_lines_by_number(
    torn: Path, damaged: Path
) -> None:
    """`read_journal` skips what cannot be read and says which lines (the supervisor's restore counts them)."""
    skipped: list[int] = []
    assert read_journal(torn, skipped) == [{"n": 1}, {"n": 2}]
    assert skipped == [3]
    skipped = []
    assert read_journal(damaged, skipped) == [{"n": 1}, {"n": 5}]
    assert skipped == [3, 4]


def test_the_report_reader_names_each_damaged_line(damaged: Path) -> None:
    """`remedy report`'s reader names FILE:LINE and why, then counts."""
    out = RunFiles()
    assert read_records(damaged, out) == [{"n": 1}, {"n": 5}]
    assert out.problems == [
        f"{damaged}:3: damaged line skipped: not JSON ({QUOTES})",
        f"{damaged}:4: damaged line skipped: a JSON list, not an object",
        f"{damaged}: 2 corrupt line(s) skipped (line 3, 4)",
    ]


def test_when_a_journal_was_last_written_skips_its_torn_tail(tmp_path: Path) -> None:
    """The `ts` of the last whole line, not of the torn one after it."""
    path = tmp_path / "history.jsonl"
    first, second = "2026-12-07T10:00:00Z", "2026-12-07T10:00:20Z"
    path.write_text(_lines({"ts": first}, {"ts": second}) + '{"ts": "2026-12-07T10:00:30Z"')
    assert last_written(path) == datetime.fromisoformat("2026-12-07T10:00:20+00:00").timestamp()


def test_a_stream_of_lines_without_newlines_reads_whole_objects() -> None:
    """The watchdog's stdin: lines split off a buffer; a damaged one dropped, the rest read."""
    items = list(jsonl.scan([b'{"token": "t"}', b"garbage", b'{"done": true}'], "stdin"))
    assert items[0] == {"token": "t"} and items[2] == {"done": True}
    assert isinstance(items[1], Damaged) and items[1].line == 2


def test_a_supervisor_death_in_the_history_asks_for_the_logs(tmp_path: Path) -> None:
    """`supervisor_died` in history.jsonl: its logs explain something; other records do not."""
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed"}))
    (tmp_path / "history.jsonl").write_text(_lines({"type": "job_state"}))
    assert not wants_logs(tmp_path)
    with (tmp_path / "history.jsonl").open("a") as fh:
        fh.write(_lines({"type": "supervisor_died", "pid": 7}))
    assert wants_logs(tmp_path)
