"""remedy's one exception base, and the errors of the supervisor side and the CLI.

Every error remedy raises outside the pure policy language derives from `RemedyError`
(the rank side's `WorkerError`, the supervisor side's `SupervisorError`), so a caller can
catch remedy's errors in one clause. They cross Ray actor boundaries, so each pickles with
its message. The policy language keeps its own base (`remedy.policies.PolicyPackageError`):
it is the bottom layer and imports nothing of remedy's.
"""

from __future__ import annotations


class RemedyError(Exception):
    """Base class for every error remedy raises outside the policy language."""

    def __reduce__(self) -> tuple[type[RemedyError], tuple[str]]:
        return (type(self), (str(self),))


class SupervisorError(RemedyError):
    """Base class for every error the supervisor side and the CLI raise."""


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
