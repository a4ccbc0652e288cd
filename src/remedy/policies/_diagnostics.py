"""Diagnostics: one located message about a policy file.

Every problem the loader, the validator or the linter finds becomes a
`Diagnostic` with the 1-based line and column of the YAML node at fault, so
editors and CI logs can jump to it. The text form is the one compilers use:
``FILE:LINE:COL: error: message``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """A message about one place in one policy file."""

    file: str
    line: int
    col: int
    message: str
    severity: Severity = "error"

    def format(self) -> str:
        """The ``FILE:LINE:COL: severity: message`` line."""
        return f"{self.file}:{self.line}:{self.col}: {self.severity}: {self.message}"

    def as_error(self) -> Diagnostic:
        """The same diagnostic promoted to an error (for `check --strict`)."""
        return Diagnostic(self.file, self.line, self.col, self.message, "error")


def sort_key(diag: Diagnostic) -> tuple[str, int, int, str]:
    """Order diagnostics by place in the file, then by text, for stable output."""
    return (diag.file, diag.line, diag.col, diag.message)
