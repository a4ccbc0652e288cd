"""Load a policy from a file, a bundled name, or text; raise `PolicyError` when it is wrong.

Loading is three passes, each of which collects every problem it can
before giving up: YAML (syntax, duplicate keys, tags), the pydantic models
(keys, types, ranges), and compilation (cross-field checks). Semantic lints
run last and are kept as `Policy.warnings`.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from remedy.policies._compile import compile_policy
from remedy.policies._diagnostics import Diagnostic, sort_key
from remedy.policies._errors import diagnostics_from
from remedy.policies._lint import lint
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


def load_policy(source: str | os.PathLike[str]) -> Policy:
    """Load and validate a policy file, or a bundled policy by name."""
    path = resolve_policy_source(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(
            [Diagnostic(str(path), 1, 1, f"cannot read policy file: {exc.strerror}")]
        ) from None
    except UnicodeDecodeError:
        raise PolicyError([Diagnostic(str(path), 1, 1, "policy file is not UTF-8 text")]) from None
    return load_policy_text(text, str(path))


def load_policy_text(text: str, filename: str = "<string>") -> Policy:
    """Validate policy YAML given as text; `filename` is used in diagnostics."""
    policy, errors = _load(text, filename)
    if errors or policy is None:
        raise PolicyError(errors)
    return policy


def diagnose_text(text: str, filename: str) -> list[Diagnostic]:
    """Every error and lint warning for a policy text, in file order (never raises)."""
    policy, errors = _load(text, filename)
    found = list(errors)
    if policy is not None:
        found.extend(policy.warnings)
    return sorted(found, key=sort_key)


def _load(text: str, filename: str) -> tuple[Policy | None, list[Diagnostic]]:
    try:
        doc = load_yaml(text, filename)
    except PolicyError as exc:
        return None, exc.diagnostics
    if doc.data is None:
        return None, [
            Diagnostic(filename, 1, 1, "policy file is empty; start with `version: 1` and `rules:`")
        ]
    if not isinstance(doc.data, dict):
        return None, [doc.error((), "a policy must be a mapping with `version:` and `rules:`")]
    try:
        model = PolicyModel.model_validate(doc.data)
    except ValidationError as exc:
        return None, sorted(diagnostics_from(exc, doc, PolicyModel), key=sort_key)
    default_name = Path(filename).stem if filename != "<string>" else "policy"
    policy, errors = compile_policy(model, doc, default_name)
    if errors:
        return None, sorted(errors, key=sort_key)
    warnings = lint(policy, doc)
    return Policy(
        name=policy.name,
        rules=policy.rules,
        source_file=policy.source_file,
        dry_run=policy.dry_run,
        inhibit=policy.inhibit,
        description=policy.description,
        warnings=tuple(warnings),
    ), []
