"""Errors raised by the supervisor package; all derive from `SupervisorError`."""

from __future__ import annotations


class SupervisorError(Exception):
    """Base class for every error the supervisor package raises."""

    def __reduce__(self) -> tuple[type[SupervisorError], tuple[str]]:
        return (type(self), (str(self),))


class TargetError(SupervisorError):
    """The training target cannot be found or imported."""


class UsageError(SupervisorError):
    """A command-line argument or input file is wrong; the message says which."""


class ClusterError(SupervisorError):
    """The Ray cluster asked for cannot be reached, or refuses remedy; the message says which."""


class Unauthorized(SupervisorError):
    """A call to a run's supervisor without that run's token; refused and counted."""


class WaitTimeout(SupervisorError):
    """A bounded wait on another process ran out; the message names the wait and its bound."""


class SupervisorLost(SupervisorError):
    """The supervisor stopped answering and was not back within its restart bound after it was
    killed; the message says since when."""
