"""Load a policy from a file, a bundled name, or text; raise `PolicyError` when it is wrong.

Loading is three passes, each of which collects every problem it can
before giving up: YAML (syntax, duplicate keys, tags), the pydantic models
(keys, types, ranges), and compilation (cross-field checks). Semantic lints
run last and are kept as `Policy.warnings`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

from pydantic import ValidationError

from remedy.policies._compile import compile_policy
from remedy.policies._diagnostics import Diagnostic, sort_key
from remedy.policies._errors import diagnostics_from
from remedy.policies._limits import cap, decode, read_bounded
from remedy.policies._lint import lint
from remedy.policies._loops import Loop, loop_diagnostics
from remedy.policies._model import PolicyModel
from remedy.policies._rules import Policy
from remedy.policies._yaml import load_yaml
from remedy.policies.exceptions import PolicyError

_PACKAGE_DIR = Path(__file__).resolve().parent
BUNDLED = ("default", "conservative", "llm-pretrain")


def bundled_policy_path(name: str) -> Path:
    """The file of a bundled policy ("default", "conservative", "llm-pretrain")."""
    if name not in BUNDLED:
        raise PolicyError(
            [Diagnostic(name, 1, 1, f"no bundled policy {name!r} (bundled: {', '.join(BUNDLED)})")]
        )
    return _PACKAGE_DIR / f"{name}.yaml"


def resolve_policy_source(source: str | os.PathLike[str]) -> Path:
    """A path as given, or the bundled file when `source` is a bundled name."""
    if isinstance(source, str) and source in BUNDLED and not Path(source).exists():
        return bundled_policy_path(source)
    return Path(source)


def read_policy_bytes(path: Path) -> bytes:
    """The bytes of a policy file, reading no more than one byte past the size limit."""
    return read_bounded(path)


def load_policy(source: str | os.PathLike[str]) -> Policy:
    """Load and validate a policy file, or a bundled policy by name."""
    path = resolve_policy_source(source)
    return load_policy_bytes(read_policy_bytes(path), str(path))


def load_policy_bytes(data: bytes, filename: str = "<bytes>") -> Policy:
    """Validate a policy given as raw bytes (a file's content, a hot reload).

    Whatever the bytes, the only exception is `PolicyError`, with located
    diagnostics (`filename` names the file in them).
    """
    return load_policy_text(data, filename)


def load_policy_text(text: str | bytes, filename: str = "<string>") -> Policy:
    """Validate policy YAML given as text (or UTF-8 bytes); `filename` is used in diagnostics."""
    policy, errors = _load(text, filename)
    if errors or policy is None:
        raise PolicyError(errors)
    return policy


def diagnose_text(text: str | bytes, filename: str, *, loop: Loop = "guard") -> list[Diagnostic]:
    """Every error and lint warning for a policy text, in file order, at most
    `MAX_DIAGNOSTICS` lines (never raises). `loop`: the loop it is meant for; a step
    that loop cannot carry out is an error (`_loops`)."""
    policy, errors = _load(text, filename, loop)
    found = list(errors)
    if policy is not None:
        found.extend(policy.warnings)
    return cap(sorted(found, key=sort_key))


# Policies compiled from a text without an error, newest last: loading is a pure function of
# (text, file name, loop) and a `Policy` is immutable, so a text loaded again (the bundled
# policy by every run, hot reload checks, `remedy policy test`) is parsed once. Successes only:
# hostile texts are not kept.
_COMPILED: OrderedDict[tuple[str | bytes, str, Loop], Policy] = OrderedDict()
_COMPILED_MAX = 16


def _load(
    text: object, filename: str, loop: Loop = "guard"
) -> tuple[Policy | None, list[Diagnostic]]:
    """The compiled policy and the errors found; None for the policy when it did not
    compile. Steps that `loop` cannot carry out are errors beside a compiled policy."""
    source = bytes(text) if isinstance(text, bytearray | memoryview) else text
    if not isinstance(source, str | bytes):  # refused with a diagnostic, never kept
        return _compile_text(source, filename, loop)
    key = (source, filename, loop)
    cached = _COMPILED.get(key)
    if cached is not None:
        _COMPILED.move_to_end(key)
        return cached, []
    policy, errors = _compile_text(source, filename, loop)
    if policy is not None and not errors:
        _COMPILED[key] = policy
        if len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.popitem(last=False)
    return policy, errors


def _compile_text(
    text: object, filename: str, loop: Loop
) -> tuple[Policy | None, list[Diagnostic]]:
    try:
        if isinstance(text, bytes | bytearray | memoryview):
            text = decode(bytes(text), filename)
        elif not isinstance(text, str):
            raise PolicyError(
                [Diagnostic(filename, 1, 1, f"policy must be text, got {type(text).__name__}")]
            )
        doc = load_yaml(text, filename)
    except PolicyError as exc:
        return None, cap(exc.diagnostics)
    if doc.data is None:
        return None, [
            Diagnostic(filename, 1, 1, "policy file is empty; start with `version: 1` and `rules:`")
        ]
    if not isinstance(doc.data, dict):
        return None, [doc.error((), "a policy must be a mapping with `version:` and `rules:`")]
    try:
        model = PolicyModel.model_validate(doc.data)
    except ValidationError as exc:
        return None, cap(sorted(diagnostics_from(exc, doc, PolicyModel), key=sort_key))
    default_name = Path(filename).stem if filename not in ("<string>", "<bytes>") else "policy"
    policy, errors = compile_policy(model, doc, default_name)
    if errors:
        return None, cap(sorted(errors, key=sort_key))
    warnings = cap(lint(policy, doc))
    refused = cap(loop_diagnostics(policy, doc, loop))
    return Policy(
        name=policy.name,
        rules=policy.rules,
        source_file=policy.source_file,
        dry_run=policy.dry_run,
        inhibit=policy.inhibit,
        description=policy.description,
        warnings=tuple(warnings),
        notify=policy.notify,
    ), refused
