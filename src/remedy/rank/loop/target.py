"""Resolve a training target: `path/to/file.py:function` or `package.module:function`."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from remedy.protocol.exceptions import TargetError


def split_target(target: str) -> tuple[str, str]:
    """Split TARGET into (module or file, function); raise TargetError if malformed."""
    where, sep, func = target.rpartition(":")
    if not sep or not where or not func.isidentifier():
        raise TargetError(
            f"target {target!r} must look like path/to/file.py:function or module:function"
        )
    return where, func


def check_target(target: str) -> str:
    """Check TARGET without running any of its code; return it with a file path made absolute.

    The file (or the module's source) must exist, parse, and bind the function
    at top level (a `def`, an assignment or an import). A module that loads its
    names dynamically (`__getattr__`, `import *`) is given the benefit of the
    doubt; its rank then reports what is missing. Raises TargetError.
    """
    where, func = split_target(target)
    if where.endswith(".py"):
        path = Path(where)
        if not path.exists():
            raise TargetError(f"target file {where} does not exist")
        if not path.is_file():
            raise TargetError(f"target {where} is not a file")
        path = path.resolve()
        _check_source(path, func, shown=where)
        return f"{path}:{func}"
    if not all(part.isidentifier() for part in where.split(".")):
        raise TargetError(f"target module {where!r} is not a Python module name")
    spec = _find_module(where)
    origin = spec.origin if spec is not None else None
    if origin and origin.endswith(".py") and os.path.isfile(origin):
        _check_source(Path(origin), func, shown=where)
    return target


def _find_module(name: str) -> importlib.machinery.ModuleSpec | None:
    # As `python -m` does: the current directory first, so a project's own packages resolve.
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise TargetError(f"cannot import module {name}: {exc}") from None
    # A parent package that raises while being imported: its error is the reason.
    except Exception as exc:
        raise TargetError(f"cannot import module {name}: {type(exc).__name__}: {exc}") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    if spec is None:
        raise TargetError(f"cannot import module {name}: no module named {name!r}")
    return spec


def _check_source(path: Path, func: str, *, shown: str) -> None:
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise TargetError(f"cannot read target {shown}: {exc.strerror}") from None
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise TargetError(
            f"{path}:{exc.lineno or 1}:{exc.offset or 1}: target does not parse: {exc.msg}"
        ) from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise TargetError(f"target {shown} does not parse: {type(exc).__name__}: {exc}") from None
    _check_imports(tree, path, shown)
    names = _top_level_names(tree)
    if func not in names and "*" not in names and "__getattr__" not in names:
        defined = sorted(
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and not n.name.startswith("_")
        )
        hint = f" (its functions: {', '.join(defined[:8])})" if defined else ""
        raise TargetError(f"{shown} has no function {func!r}{hint}")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == func:
            _check_signature(node, shown)


def _check_signature(node: ast.FunctionDef | ast.AsyncFunctionDef, shown: str) -> None:
    """The target is called with no argument or with one (the arguments after `--`)."""
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    required = len(positional) - len(a.defaults)
    required_kw = [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]
    if required > 1 or required_kw:
        raise TargetError(
            f"{shown}:{node.lineno}: {node.name}() must take no argument or one "
            "(the list of arguments after `--`)"
        )
    if isinstance(node, ast.AsyncFunctionDef):
        raise TargetError(f"{shown}:{node.lineno}: {node.name}() is async; give a plain function")


def _check_imports(tree: ast.Module, path: Path, shown: str) -> None:
    """Every unconditional top-level `import X` must name an installed or sibling module.

    Imports inside `try`/`if` are left alone: they are how optional packages are written.
    """
    search = [str(path.parent), os.getcwd()]
    for node in tree.body:
        if isinstance(node, ast.Import):
            roots = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots = [node.module.split(".")[0]]
        else:
            continue
        for root in roots:
            if root in sys.modules or importlib.machinery.PathFinder.find_spec(root, search):
                continue
            try:
                found = importlib.util.find_spec(root)
            except (ImportError, ValueError):
                found = None
            if found is None:
                raise TargetError(
                    f"{path}:{node.lineno}: target {shown} imports {root!r}, "
                    "which is not installed here"
                )


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names bound at module level, also inside top-level if/try blocks."""
    names: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try | ast.With):
            stack.extend(node.body)
            stack.extend(getattr(node, "orelse", []))
            stack.extend(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                stack.extend(handler.body)
    return names


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


# Files under these folders are remedy's or Python's, not the user's.
_REMEDY_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
_NOT_USER = (
    _REMEDY_DIR + os.sep,  # src/remedy/, this file being src/remedy/rank/loop/target.py
    os.path.dirname(os.path.realpath(inspect.__file__)) + os.sep,
)
_TRACEBACK_CHARS = 4000


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """What a person needs about a training function's exception, as plain picklable data.

    `error_frame` is the innermost frame of the user's code (not remedy's, not
    Python's or an installed package's), `FILE:LINE in FUNCTION`.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if is_user_file(f.filename)]
    # No user frame (the target could not even be imported): the message says it all.
    frame = user[-1] if user else None
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "error_type": type(exc).__name__,
        "error_message": str(exc)[:_TRACEBACK_CHARS],
        "error_frame": f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else None,
        "traceback": text[-_TRACEBACK_CHARS:],
    }


def is_user_file(filename: str) -> bool:
    """True for a file of the user's code: not remedy's, Python's or an installed package's."""
    path = os.path.realpath(filename)
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts or filename.startswith("<"):
        return False
    return not path.startswith(_NOT_USER)


def picklable_result(result: Any) -> tuple[Any, str | None]:
    """The training function's return value if it can travel back to the driver, else its repr.

    Returns (value, note); the note says why the value was replaced.
    """
    from ray import cloudpickle  # noqa: PLC0415 - the CLI checks targets without importing Ray

    try:
        cloudpickle.dumps(result)
    except Exception as exc:  # any pickling failure: the value stays behind, the rank lives
        return repr(result)[:_TRACEBACK_CHARS], f"return value not picklable: {type(exc).__name__}"
    return result, None
