"""The one reader of JSON-lines files: the run directory's journals, and any stream of JSON lines.

Every line is one JSON object. A process killed mid-write leaves its file's
last line cut short (no newline after it): that *torn* line is skipped by
every reader. Any other line that is not a JSON object is *damaged* (a disk
error, a person's editor); a reader either skips it and hands it back to be
counted and named (`Damaged`, located as `FILE:LINE:COL`), or, reading
strictly, raises `JsonlError` with that location.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Damaged:
    """A line that is not a JSON object: where it is and why (`torn`: the file's last line,
    without its newline, as a write cut short leaves it)."""

    path: str
    line: int
    column: int
    why: str
    torn: bool = False

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}: error: {self.why}"


class JsonlError(ValueError):
    """A damaged line met by a strict read; its message is the line's `FILE:LINE:COL: error:`."""

    def __init__(self, damaged: Damaged) -> None:
        super().__init__(str(damaged))
        self.damaged = damaged

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.damaged,))


def parse(text: str | bytes) -> dict[str, Any] | tuple[int, str]:
    """One line: its JSON object, or (column, why) when it is not one."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return exc.colno, f"not JSON ({exc.msg})"
    except (ValueError, RecursionError) as exc:
        return 1, f"not JSON ({type(exc).__name__})"
    if not isinstance(record, dict):
        return 1, f"a JSON {type(record).__name__}, not an object"
    return record


def scan(
    lines: Iterable[str | bytes], path: str = "<stream>"
) -> Iterator[dict[str, Any] | Damaged]:
    """Each non-blank line of `lines` in order, numbered from 1: its object, or a `Damaged`
    naming it. Every line but the last ends with its newline; a last one without it that does
    not parse is `torn`."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        parsed = parse(line)
        if isinstance(parsed, dict):
            yield parsed
            continue
        column, why = parsed
        torn = not (line.endswith(b"\n") if isinstance(line, bytes) else line.endswith("\n"))
        yield Damaged(path, number, column, why, torn)


def scan_text(text: str, path: str = "<stream>") -> Iterator[dict[str, Any] | Damaged]:
    """`scan` over the lines of `text` (split at "\\n", as a file is read)."""
    pieces = text.split("\n")
    last = pieces.pop()  # "" when `text` ends with a newline
    yield from scan([*(piece + "\n" for piece in pieces), last], path)


def records(
    path: str | os.PathLike[str],
    *,
    damaged: list[Damaged] | None = None,
    strict: bool = False,
) -> Iterator[dict[str, Any]]:
    """The JSON objects of the file at `path`, in order (a missing file has none).

    Damaged lines are skipped and added to `damaged` where given; reading
    `strict`ly, one raises `JsonlError` instead. A torn last line is skipped
    either way (and added to `damaged`).
    """
    p = Path(path)
    if not p.exists():
        return
    with open(p, "rb") as fh:
        for item in scan(fh, str(p)):
            if isinstance(item, dict):
                yield item
                continue
            if strict and not item.torn:
                raise JsonlError(item)
            if damaged is not None:
                damaged.append(item)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file (a missing file reads as empty); a damaged line other
    than a torn last one raises `JsonlError` naming it."""
    return list(records(path, strict=True))
