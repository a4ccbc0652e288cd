"""Names of a package loaded on first use (PEP 562), so that importing one of its light
modules does not import its heavy ones: the supervisor's core takes the command records
without the Guard (and torch), a rank takes the anomaly records without the policy loader."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(
    package: str, names: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, whose `names` map each name to its module.

    A name is imported from its module when first asked for, then kept in the
    package's `namespace` (its `globals()`), so the next lookup is a plain one.
    """

    def getattr_(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(names)

    return getattr_, dir_
