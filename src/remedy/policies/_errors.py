"""Turn pydantic validation errors into located diagnostics.

Pydantic reports each error with a `loc` path through the data; policy
models are shaped so that, once the union tags (`UNION_TAGS`: "~map"...) are
dropped, that path is the YAML path, and `Document.locate` gives the line
and column. Unknown keys point at the key and suggest the closest known
one; every other error points at the offending value.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from remedy.policies._diagnostics import Diagnostic
from remedy.policies._model import UNION_TAGS, Strict
from remedy.policies._params import ActionParams
from remedy.policies._types import suggest
from remedy.policies._yaml import Document, Path

_TYPE_NAMES = {
    "dict": "a mapping",
    "list": "a list",
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "NoneType": "nothing (null)",
}


def diagnostics_from(
    error: ValidationError, doc: Document, root: type[BaseModel]
) -> list[Diagnostic]:
    """One diagnostic per pydantic error, located in `doc`."""
    out: list[Diagnostic] = []
    for detail in error.errors(include_url=False):
        loc = tuple(detail["loc"])
        if detail["type"] == "extra_forbidden" and loc:
            # The last item is the user's key itself, whatever it is spelt like ("~version").
            path: Path = (*_untagged(loc[:-1]), loc[-1])
        else:
            path = _untagged(loc)
        if path and path[-1] == "[key]":
            # A bad mapping key (e.g. an unknown anomaly kind as a stream key): point at the key.
            out.append(doc.error(path[:-1], _message(detail, path[:-1], root), key=True))
        elif detail["type"] == "extra_forbidden":
            out.append(doc.error(path, _unknown_key(path, root), key=True))
        else:
            out.append(doc.error(path, _message(detail, path, root)))
    return out


def _untagged(loc: tuple[Any, ...]) -> Path:
    """`loc` without the union tags pydantic puts in it (`_model.UNION_TAGS`)."""
    return tuple(p for p in loc if not (isinstance(p, str) and p in UNION_TAGS))


def _message(detail: ErrorDetails, path: Path, root: type[BaseModel]) -> str:
    kind = detail["type"]
    field = _last_key(path)
    if kind == "missing":
        model = _model_at(root, path[:-1])
        where = getattr(model, "place", "here")
        return f"missing required key {field!r} in {where}"
    if kind in {"model_type", "dict_type", "model_attributes_type"}:
        text = f"expected a mapping, got {_describe(detail['input'])}"
    elif kind == "list_type":
        text = f"expected a list, got {_describe(detail['input'])}"
    elif kind == "too_short":
        text = "needs at least one entry"
    else:
        text = detail["msg"]
        text = text.removeprefix("Value error, ")
    return f"{field}: {text}" if field else text


def _unknown_key(path: Path, root: type[BaseModel]) -> str:
    key = str(path[-1])
    model = _model_at(root, path[:-1])
    if model is None:
        return f"unknown key {key!r}"
    known = [f.alias or name for name, f in model.model_fields.items()]
    if issubclass(model, ActionParams):
        action = _last_key(path[:-1])
        valid = ", ".join(known) if known else "none: it takes no parameters"
        hint = suggest(key, known)
        return f"unknown parameter {key!r} for {action}{hint} (valid: {valid})"
    if not issubclass(model, Strict):
        return f"unknown key {key!r}"
    if model.noun == "action":
        actions = [k for k in known if k != "on_failure"]
        return f"unknown action {key!r}{suggest(key, known)} (valid: {', '.join(actions)})"
    hint = suggest(key, known)
    if not hint:
        hint = f" (valid: {', '.join(known)})"
    return f"unknown {model.noun} {key!r} in {model.place}{hint}"


def _last_key(path: Path) -> str:
    for part in reversed(path):
        if isinstance(part, str):
            return part
    return ""


def _describe(value: Any) -> str:
    name = _TYPE_NAMES.get(type(value).__name__, type(value).__name__)
    return name if isinstance(value, dict | list) or value is None else f"{value!r}"


def _model_at(root: type[BaseModel], path: Sequence[str | int]) -> type[BaseModel] | None:
    """Follow `path` through the model classes to the model that holds its last key."""
    candidates: list[type[BaseModel]] = [root]
    for part in path:
        if isinstance(part, int):
            continue
        following: list[type[BaseModel]] = []
        for model in candidates:
            for name, info in model.model_fields.items():
                if part in (name, info.alias):
                    following.extend(_models_in(info.annotation))
        if not following:
            return None
        candidates = following
    return candidates[0]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The model classes reachable inside an annotation (through Annotated, unions, lists)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is None and not isinstance(annotation, types.UnionType):
        return []
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(_models_in(arg))
    return found
