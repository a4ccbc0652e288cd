"""Process-level chaos faults: a hung rank, a killed rank, a slow collective, a full disk.

`hang_rank` stops the rank's own process (SIGSTOP: it answers nothing, as a
rank wedged in a driver call or a stuck collective), `kill_rank` kills it
(SIGKILL), `slow_collective` sleeps after the backward, so the peers wait
for the rank at its next collective. Each fires once per *run*, not per
process (`FaultInjector.fire_once` marks it in the run directory before it
acts): the replacement of a killed rank replays the same step and must not
fire again.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import time
from collections.abc import Iterator


def hang() -> None:
    """Stop this process (SIGSTOP) until someone kills or continues it."""
    os.kill(os.getpid(), signal.SIGSTOP)


def kill() -> None:
    """Kill this process (SIGKILL): no handler, no flush, as a node losing power."""
    os.kill(os.getpid(), signal.SIGKILL)


def slow(seconds: float) -> None:
    """Arrive `seconds` late at the step's collectives."""
    time.sleep(seconds)


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """No file this process writes may grow past `limit` bytes meanwhile (RLIMIT_FSIZE).

    A write past it fails with a real EFBIG from the kernel, as on a full or
    quota-bound disk (Python ignores SIGXFSZ, so the write returns the error
    instead of killing the process). The limit is the whole process's: keep the
    span short.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
