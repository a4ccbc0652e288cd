"""Targets whose signatures `remedy run` cannot call: it passes no argument or one."""

from __future__ import annotations


def two_args(argv: list[str], config: dict[str, int]) -> None:
    """Needs a second argument nobody passes."""
    del argv, config


def kw_only(*, config: dict[str, int]) -> None:
    """Needs a keyword argument nobody passes."""
    del config


async def async_main() -> None:
    """A coroutine: calling it would not run it."""


def fine(argv: list[str], verbose: bool = False) -> None:
    """Callable with the pass-through arguments."""
    del argv, verbose
