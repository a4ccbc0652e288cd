"""Process-level chaos faults of multi-rank jobs: a hung rank, a killed rank, a slow collective.

`hang_rank` stops the rank's own process (SIGSTOP: it answers nothing, as a
rank wedged in a driver call or a stuck collective), `kill_rank` kills it
(SIGKILL), `slow_collective` sleeps after the backward, so the peers wait
for the rank at its next collective. Each fires once per *run*, not per
process (`FaultInjector.fire_once` marks it in the run directory before it
acts): the replacement of a killed rank replays the same step and must not
fire again.
"""

from __future__ import annotations

import os
import signal
import time


def hang() -> None:
    """Stop this process (SIGSTOP) until someone kills or continues it."""
    os.kill(os.getpid(), signal.SIGSTOP)


def kill() -> None:
    """Kill this process (SIGKILL): no handler, no flush, as a node losing power."""
    os.kill(os.getpid(), signal.SIGKILL)


def slow(seconds: float) -> None:
    """Arrive `seconds` late at the step's collectives."""
    time.sleep(seconds)
