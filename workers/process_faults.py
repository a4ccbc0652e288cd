"""Process-level chaos faults of multi-rank jobs: a hung rank, a killed rank, a slow collective.

`hang_rank` stops the rank's own process (SIGSTOP: it answers nothing, as a
rank wedged in a driver call or a stuck collective), `kill_rank` kills it
(SIGKILL), `slow_collective` sleeps inside the step where the rank's
all-reduce runs. Each fires once per *run*, not per process: the
replacement of a killed rank replays the same step and must not fire again.
A marker file in the run directory (`chaos/<kind>-rank<r>-step<s>`,
created exclusively) records the firing; without a run directory the fault
fires once per process.
"""

from __future__ import annotations

import os
import signal
import time

from remedy.workers.context import get_context


def first_time_in_run(kind: str, rank: int, step: int) -> bool:
    """True exactly once per run for (kind, rank, step)."""
    ctx = get_context()
    if ctx is None or ctx.run_dir is None:
        return True
    folder = ctx.run_dir / "chaos"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(folder / f"{kind}-rank{rank}-step{step}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(f"{time.time()}\n")
        fh.flush()
        os.fsync(fh.fileno())
    return True


def hang(rank: int, step: int) -> None:
    """Stop this process (SIGSTOP) if the fault has not fired in this run yet."""
    if first_time_in_run("hang_rank", rank, step):
        os.kill(os.getpid(), signal.SIGSTOP)


def kill(rank: int, step: int) -> None:
    """Kill this process (SIGKILL) if the fault has not fired in this run yet."""
    if first_time_in_run("kill_rank", rank, step):
        os.kill(os.getpid(), signal.SIGKILL)


def slow(rank: int, step: int, seconds: float) -> bool:
    """Sleep `seconds` (a collective that takes that long to return); True if it fired."""
    if first_time_in_run("slow_collective", rank, step):
        time.sleep(seconds)
        return True
    return False
