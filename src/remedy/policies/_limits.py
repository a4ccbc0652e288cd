"""What a policy file may be: bounded size, nesting and numbers, no aliases, UTF-8 text.

A policy arrives from a user's editor, a CI job or a hot reload of whatever
bytes were saved, so the loader bounds the work it does before handing the
text to the YAML parser: at most `MAX_POLICY_BYTES`, no control characters,
nesting at most `MAX_DEPTH` deep, at most `MAX_NODES` values with each alias
(``*name``) counted as the values it stands for (an alias bomb of a few
hundred bytes would otherwise expand to gigabytes), no number longer than
`MAX_NUMBER_CHARS`. Each refusal is one located diagnostic. `cap` keeps a
report readable: at most `MAX_DIAGNOSTICS` lines, then "... and N more".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import (
    AliasEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
)

from remedy.policies._diagnostics import Diagnostic
from remedy.policies.exceptions import PolicyError

MAX_POLICY_BYTES = 64 * 1024
MAX_TEST_FILE_BYTES = 1024 * 1024  # policy test files (`remedy policy test`) hold long streams
MAX_DEPTH = 32
MAX_NUMBER_CHARS = 40
MAX_NODES = 20_000  # values in the document, each alias counted as what it stands for
MAX_DIAGNOSTICS = 20

# C0 controls other than tab, newline and carriage return; DEL; C1 controls other
# than NEL; lone surrogates; and the non-characters YAML refuses.
_CONTROL = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\x80-\x84\x86-\x9f\ud800-\udfff\ufeff\ufffe\uffff]"
)
_NUMBERISH = re.compile(r"[-+]?[0-9][0-9_,.eE+-]*|[-+]?\.[0-9][0-9_eE+-]*")


def read_bounded(path: Path, *, limit: int = MAX_POLICY_BYTES, noun: str = "policy file") -> bytes:
    """A regular file's bytes, reading no more than one byte past `limit`; else PolicyError.

    A FIFO or a device (``/dev/zero``) is refused before it is opened: reading
    one could block for ever or never end.
    """
    try:
        if path.exists() and not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file"
            raise PolicyError([Diagnostic(str(path), 1, 1, f"cannot read {noun}: {kind}")])
        with path.open("rb") as handle:
            return handle.read(limit + 1)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise PolicyError([Diagnostic(str(path), 1, 1, f"cannot read {noun}: {why}")]) from None


def decode(
    data: bytes, filename: str, *, limit: int = MAX_POLICY_BYTES, noun: str = "policy file"
) -> str:
    """UTF-8 text from bytes (a UTF-8 byte-order mark is dropped); else a located PolicyError."""
    if len(data) > limit:
        raise PolicyError([_too_big(len(data), filename, limit, noun)])
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise PolicyError([Diagnostic(filename, 1, 1, f"{noun} is UTF-16 text; save it as UTF-8")])
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, col = _line_col(data, exc.start)
        byte = data[exc.start]
        raise PolicyError(
            [Diagnostic(filename, line, col, f"{noun} is not UTF-8 text (byte 0x{byte:02x})")]
        ) from None


def check_text(
    text: str, filename: str, *, limit: int = MAX_POLICY_BYTES, noun: str = "policy file"
) -> str:
    """The text to parse (a leading byte-order mark dropped), if it is within bounds.

    Refuses text that is too big, holds control characters, nests too deep,
    expands (through aliases) to too many values or holds overlong numbers,
    with a located `PolicyError`.
    """
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        size = len(text) * 4
    if size > limit:
        raise PolicyError([_too_big(size, filename, limit, noun)])
    bad = _CONTROL.search(text)
    if bad is not None:
        line, col = _text_line_col(text, bad.start())
        code = f"U+{ord(bad.group()):04X}"
        raise PolicyError(
            [Diagnostic(filename, line, col, f"control character {code} is not allowed here")]
        )
    _check_brackets(text, filename)
    _check_events(text, filename)
    return text


def cap(diagnostics: Sequence[Diagnostic], limit: int = MAX_DIAGNOSTICS) -> list[Diagnostic]:
    """At most `limit` diagnostics, the last saying how many more there were."""
    found = list(diagnostics)
    if len(found) <= limit:
        return found
    rest = found[limit - 1 :]
    first = rest[0]
    errors = sum(d.severity == "error" for d in rest)
    kinds = "errors" if errors == len(rest) else "problems"
    note = Diagnostic(
        first.file,
        first.line,
        first.col,
        f"... and {len(rest)} more {kinds} (showing the first {limit - 1})",
        "error" if errors else "warning",
    )
    return [*found[: limit - 1], note]


def _check_brackets(text: str, filename: str) -> None:
    """A cheap bound on flow nesting before the parser sees it (its cost grows with depth).

    Brackets are counted without regard to quoting, so the bound is generous;
    `_check_events` enforces `MAX_DEPTH` exactly.
    """
    depth = 0
    limit = 4 * MAX_DEPTH
    for match in re.finditer(r"[\[\]{}]", text):
        depth = depth + 1 if match.group() in "[{" else max(0, depth - 1)
        if depth > limit:
            line, col = _text_line_col(text, match.start())
            raise PolicyError([_too_deep(filename, line, col)])


def _check_events(text: str, filename: str) -> None:
    """Walk the YAML events: bound nesting, expanded size (aliases count as what they
    stand for) and numbers, before anything is built from them."""
    total = 0  # nodes so far, each alias counted as the nodes of what it names
    # Per open collection: anchor, total at start, height, and (mappings) children so far.
    open_nodes: list[list[Any]] = []
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, height)
    try:
        for event in YAML(typ="rt").parse(text):
            grow, height = 0, 0
            is_node = isinstance(
                event, MappingStartEvent | SequenceStartEvent | ScalarEvent | AliasEvent
            )
            if is_node and open_nodes and open_nodes[-1][3] is not None:
                at_key = open_nodes[-1][3] % 2 == 0
                open_nodes[-1][3] += 1
                collection = isinstance(event, MappingStartEvent | SequenceStartEvent) or (
                    isinstance(event, AliasEvent) and sizes.get(event.anchor or "", (1, 0))[1]
                )
                if at_key and collection:
                    message = "mapping keys must be strings, not lists or mappings"
                    raise PolicyError([Diagnostic(filename, *_mark(event), message)])
            if isinstance(event, MappingStartEvent | SequenceStartEvent):
                total += 1
                children = 0 if isinstance(event, MappingStartEvent) else None
                open_nodes.append([event.anchor, total, 1, children])
                if len(open_nodes) > MAX_DEPTH:
                    raise PolicyError([_too_deep(filename, *_mark(event))])
                continue
            if isinstance(event, MappingEndEvent | SequenceEndEvent):
                anchor, start, height, _ = open_nodes.pop()
                if anchor is not None:
                    sizes[anchor] = (total - start + 1, height)
                if open_nodes:
                    open_nodes[-1][2] = max(open_nodes[-1][2], height + 1)
                continue
            if isinstance(event, AliasEvent):
                if any(entry[0] == event.anchor for entry in open_nodes):
                    message = f"alias *{event.anchor} refers to a value that contains it"
                    raise PolicyError([Diagnostic(filename, *_mark(event), message)])
                grow, height = sizes.get(event.anchor or "", (1, 0))
            elif isinstance(event, ScalarEvent):
                grow = 1
                if event.anchor is not None:
                    sizes[event.anchor] = (1, 0)
                if _overlong_number(event):
                    raise PolicyError(
                        [
                            Diagnostic(
                                filename,
                                *_mark(event),
                                f"number of {len(event.value)} characters is too long "
                                f"(at most {MAX_NUMBER_CHARS})",
                            )
                        ]
                    )
            else:
                continue
            total += grow
            if total > MAX_NODES:
                raise PolicyError([_too_many(filename, *_mark(event))])
            if height:
                if len(open_nodes) + height > MAX_DEPTH:
                    raise PolicyError([_too_deep(filename, *_mark(event))])
                if open_nodes:
                    open_nodes[-1][2] = max(open_nodes[-1][2], height + 1)
    except (MarkedYAMLError, YAMLError):
        return  # syntax errors are reported, located, by the loader's own parse


def _overlong_number(event: ScalarEvent) -> bool:
    return (
        event.style is None
        and len(event.value) > MAX_NUMBER_CHARS
        and _NUMBERISH.fullmatch(event.value) is not None
    )


def _too_many(filename: str, line: int, col: int) -> Diagnostic:
    return Diagnostic(
        filename,
        line,
        col,
        f"the document expands to more than {MAX_NODES} values (aliases count as what they "
        "stand for)",
    )


def _too_big(size: int, filename: str, limit: int, noun: str) -> Diagnostic:
    del size  # a file is read only up to one byte past the limit: its size is unknown
    return Diagnostic(filename, 1, 1, f"{noun} is larger than {limit} bytes, the most it may be")


def _too_deep(filename: str, line: int, col: int) -> Diagnostic:
    return Diagnostic(filename, line, col, f"nesting deeper than {MAX_DEPTH} levels")


def _mark(event: object) -> tuple[int, int]:
    mark = getattr(event, "start_mark", None)
    if mark is None:
        return (1, 1)
    return (mark.line + 1, mark.column + 1)


def _line_col(data: bytes, offset: int) -> tuple[int, int]:
    start = data.rfind(b"\n", 0, offset) + 1
    return data.count(b"\n", 0, offset) + 1, len(data[start:offset].decode("utf-8", "replace")) + 1


def _text_line_col(text: str, offset: int) -> tuple[int, int]:
    start = text.rfind("\n", 0, offset) + 1
    return text.count("\n", 0, offset) + 1, offset - start + 1
