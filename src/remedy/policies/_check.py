"""`check_policy`: every error and lint warning for a policy file, without raising."""

from __future__ import annotations

import os

from remedy.policies._diagnostics import Diagnostic, sort_key
from remedy.policies._loader import diagnose_text, read_policy_bytes, resolve_policy_source
from remedy.policies._loops import Loop
from remedy.policies.exceptions import PolicyError


def check_policy(
    path: str | os.PathLike[str], *, strict: bool = False, loop: Loop = "guard"
) -> list[Diagnostic]:
    """Errors and semantic warnings for one policy file; with `strict`, warnings become errors.

    `loop`: the loop the policy is meant for (`guard`, or `callbacks` for the Hugging Face
    and Lightning callbacks); a step of an action that loop cannot carry out is an error.
    """
    file = resolve_policy_source(path)
    try:
        data = read_policy_bytes(file)
    except PolicyError as exc:
        return exc.diagnostics
    found = diagnose_text(data, str(file), loop=loop)
    if strict:
        found = [d.as_error() for d in found]
    return sorted(found, key=sort_key)
