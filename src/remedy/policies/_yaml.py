"""Safe YAML loading that remembers where every node came from.

Policies are read with ruamel.yaml's round-trip loader, which keeps the line
and column of every key and value; the tree is then copied into plain Python
values (dict, list, str, int, float, bool, None) and a table of positions
keyed by path. Nothing in the file is evaluated: tagged nodes
(``!!python/object`` and friends), dates and other non-JSON values are
reported as errors, and duplicate keys are errors too.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq, TaggedScalar
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.scalarbool import ScalarBoolean

from remedy.policies._diagnostics import Diagnostic
from remedy.policies._limits import MAX_POLICY_BYTES, check_text
from remedy.policies.exceptions import PolicyError

Path = tuple[str | int, ...]
Pos = tuple[int, int]


@dataclass(frozen=True)
class Document:
    """Plain data loaded from YAML, with the 1-based position of every node."""

    file: str
    data: Any
    key_pos: dict[Path, Pos] = field(default_factory=dict)
    value_pos: dict[Path, Pos] = field(default_factory=dict)

    def locate(self, path: Sequence[str | int], *, key: bool = False) -> Pos:
        """Position of the node at `path`, or of its deepest existing ancestor.

        With `key=True` the position of the mapping key is preferred (where an
        unknown key should be reported); otherwise the value's.
        """
        full = tuple(path)
        if key and full in self.key_pos:
            return self.key_pos[full]
        for end in range(len(full), 0, -1):
            pos = self.value_pos.get(full[:end])
            if pos is not None:
                return pos
        return self.value_pos.get((), (1, 1))

    def error(self, path: Sequence[str | int], message: str, *, key: bool = False) -> Diagnostic:
        """A located error diagnostic about the node at `path`."""
        line, col = self.locate(path, key=key)
        return Diagnostic(self.file, line, col, message)

    def warning(self, path: Sequence[str | int], message: str, *, key: bool = False) -> Diagnostic:
        """A located warning diagnostic about the node at `path`."""
        line, col = self.locate(path, key=key)
        return Diagnostic(self.file, line, col, message, "warning")


def load_yaml(
    text: str, filename: str, *, limit: int = MAX_POLICY_BYTES, noun: str = "policy file"
) -> Document:
    """Parse `text`; raise `PolicyError` with located diagnostics if it is not plain YAML data.

    The text is first held to the bounds of `_limits` (size, characters,
    nesting, aliases, numbers), so parsing stays cheap whatever it holds.
    """
    text = check_text(text, filename, limit=limit, noun=noun)
    yaml = YAML(typ="rt")
    yaml.allow_duplicate_keys = False
    try:
        raw = yaml.load(text)
    except MarkedYAMLError as exc:
        raise PolicyError([_syntax_diagnostic(exc, filename)]) from None
    except YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PolicyError([Diagnostic(filename, 1, 1, f"YAML error: {first}")]) from None
    except (TypeError, ValueError, RecursionError) as exc:
        # What check_text does not foresee must still be one located line, not a traceback.
        why = f"{type(exc).__name__}: {str(exc)[:100]}"
        raise PolicyError([Diagnostic(filename, 1, 1, f"YAML could not be read ({why})")]) from None
    doc = Document(filename, None)
    errors: list[Diagnostic] = []
    doc.value_pos[()] = _node_pos(raw) or (1, 1)
    data = _plain(raw, (), doc, errors)
    if errors:
        raise PolicyError(errors)
    return Document(filename, data, doc.key_pos, doc.value_pos)


def _syntax_diagnostic(exc: MarkedYAMLError, filename: str) -> Diagnostic:
    mark = exc.problem_mark or exc.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
    problem = exc.problem or exc.context or "invalid YAML"
    problem = problem.split("\n")[0].strip()
    if exc.context and exc.problem and "duplicate key" not in problem:
        problem = f"{problem} ({exc.context.strip()})"
    if "duplicate key" in problem:
        problem = problem.split(" with value")[0].replace("found duplicate", "duplicate")
    return Diagnostic(filename, line, col, f"YAML syntax: {problem}")


def _node_pos(node: Any) -> Pos | None:
    lc = getattr(node, "lc", None)
    if lc is None or lc.line is None:
        return None
    return (lc.line + 1, lc.col + 1)


def _plain(node: Any, path: Path, doc: Document, errors: list[Diagnostic]) -> Any:
    """Copy a ruamel node into plain Python values, recording positions of children."""
    if _has_custom_tag(node):
        errors.append(doc.error(path, "YAML tags are not allowed in policy files"))
        return None
    if isinstance(node, TaggedScalar):
        return str(node.value)  # only `!!str` gets here: the other core tags resolve to values
    if isinstance(node, CommentedMap):
        out: dict[str, Any] = {}
        for key in node:
            child: Path = (*path, str(key))
            _record(doc, child, node.lc, key, path)
            if not isinstance(key, str):
                errors.append(
                    doc.error(child, f"mapping keys must be strings, got {key!r}", key=True)
                )
                continue
            out[key] = _plain(node[key], child, doc, errors)
        return out
    if isinstance(node, CommentedSeq):
        items: list[Any] = []
        for index, item in enumerate(node):
            child = (*path, index)
            try:
                line, col = node.lc.item(index)
                doc.value_pos[child] = (line + 1, col + 1)
            except (KeyError, TypeError):
                doc.value_pos[child] = doc.locate(path)
            items.append(_plain(item, child, doc, errors))
        return items
    if isinstance(node, ScalarBoolean):
        return bool(node)
    if node is None or isinstance(node, bool | str):
        return node if node is None or isinstance(node, bool) else str(node)
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, dt.date | dt.datetime):
        errors.append(doc.error(path, f"dates are not allowed here; quote {str(node)!r} if text"))
        return None
    errors.append(doc.error(path, f"unsupported YAML value of type {type(node).__name__}"))
    return None


_CORE_TAGS = frozenset(
    f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "null", "seq", "map")
)


def _has_custom_tag(node: Any) -> bool:
    """True for any explicit tag beyond the core schema (`!!python/...`, `!custom`)."""
    tag = getattr(node, "tag", None)
    value = getattr(tag, "value", None)
    return isinstance(value, str) and value not in _CORE_TAGS


def _record(doc: Document, child: Path, lc: Any, key: Any, parent: Path) -> None:
    # Keys pulled in by a `<<` merge have no position of their own; use the parent's.
    try:
        kline, kcol = lc.key(key)
        doc.key_pos[child] = (kline + 1, kcol + 1)
    except (KeyError, TypeError):
        doc.key_pos[child] = doc.locate(parent)
    try:
        vline, vcol = lc.value(key)
        doc.value_pos[child] = (vline + 1, vcol + 1)
    except (KeyError, TypeError):
        doc.value_pos[child] = doc.key_pos[child]
