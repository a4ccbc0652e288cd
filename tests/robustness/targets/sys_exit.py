"""Training functions that end with sys.exit: 0 is a normal end, 3 a failure."""

from __future__ import annotations

import sys


def clean() -> None:
    """sys.exit(0): done."""
    sys.exit(0)


def dirty() -> None:
    """sys.exit(3): the user's own failure code."""
    sys.exit(3)
