"""A training function that fails before its first step (a bad configuration)."""

from __future__ import annotations


def main() -> None:
    """Refuse the configuration at once."""
    raise ValueError("learning rate must be positive, got -3")
