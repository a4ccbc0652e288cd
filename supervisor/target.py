"""Resolve a training target: `path/to/file.py:function` or `package.module:function`."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from remedy.supervisor.exceptions import TargetError


def split_target(target: str) -> tuple[str, str]:
    """Split TARGET into (module or file, function); raise TargetError if malformed."""
    where, sep, func = target.rpartition(":")
    if not sep or not where or not func.isidentifier():
        raise TargetError(
            f"target {target!r} must look like path/to/file.py:function or module:function"
        )
    return where, func


def load_target(target: str) -> Callable[..., Any]:
    """Import the function named by TARGET.

    A file target is loaded like a script: its directory goes on `sys.path`
    first, so it can import its sibling modules.
    """
    where, func = split_target(target)
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise TargetError(f"target file {where} does not exist")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(f"remedy_target_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise TargetError(f"cannot load {where}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise TargetError(f"cannot import {where}: {exc}") from exc
    fn: Callable[..., Any] | None = getattr(module, func, None)
    if not callable(fn):
        raise TargetError(f"{where} has no function {func!r}")
    return fn


def call_target(fn: Callable[..., Any], argv: list[str]) -> Any:
    """Call the target with the pass-through arguments if it takes a parameter."""
    params = inspect.signature(fn).parameters
    return fn(argv) if params else fn()
