"""`check_policy`: every error and lint warning for a policy file, without raising."""

from __future__ import annotations

import os

from remedy.policies._diagnostics import Diagnostic, sort_key
from remedy.policies._loader import diagnose_text, resolve_policy_source


def check_policy(path: str | os.PathLike[str], *, strict: bool = False) -> list[Diagnostic]:
    """Errors and semantic warnings for one policy file; with `strict`, warnings become errors."""
    file = resolve_policy_source(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        return [Diagnostic(str(file), 1, 1, f"cannot read policy file: {exc.strerror}")]
    except UnicodeDecodeError:
        return [Diagnostic(str(file), 1, 1, "policy file is not UTF-8 text")]
    found = diagnose_text(text, str(file))
    if strict:
        found = [d.as_error() for d in found]
    return sorted(found, key=sort_key)
