"""Process-wide logging setup for remedy's own log lines (not the journals)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(*, verbose: bool = False) -> None:
    """Human-readable key=value lines on stderr; warnings only unless `verbose`."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.INFO if verbose else logging.WARNING
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
