"""Why a supervisor's process ended, in one word and one sentence, for `supervisor_died`.

Two witnesses: Ray's record of the worker process (its exit type and
detail, from the GCS: `lineage.death_of`), and the kernel's log. Ray cannot
tell a SIGKILL from the kernel's OOM killer: both read `SYSTEM_ERROR`,
"Worker unexpectedly exits ...", with a list of possible causes. The
kernel names every process its OOM killer ends ("Killed process PID
(...)", also for a container's memory cgroup), so where its log is
readable (`/dev/kmsg`: root, or `kernel.dmesg_restrict=0`) the two are
told apart; where it is not, the sentence says that it could not be told.

`cause` is one of:

| cause | what ended it |
| --- | --- |
| `oom_killer` | the kernel's OOM killer (the kernel log's line is quoted) |
| `ray_memory_monitor` | Ray's memory monitor (`NODE_OUT_OF_MEMORY`) |
| `signal` | a signal or a crash: SIGKILL, SIGSEGV, ... (no OOM kill in the kernel log) |
| `signal_or_oom` | the same, where the kernel log could not be read |
| `exited` | the process exited (Ray's intended exits) |
| `error` | an error of the supervisor's own (`USER_ERROR`) |
| `unknown` | Ray holds no record of it |
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from typing import Any

KMSG = "/dev/kmsg"
# How much of the kernel log is read at most (its ring buffer is far smaller).
KMSG_LIMIT = 16 << 20
# How far the kernel's clock and the wall clock may disagree over a process's start.
CLOCK_SLACK_S = 5.0


def kernel_oom_kill(
    pid: int, kmsg: str = KMSG, *, since: float | None = None
) -> tuple[bool, str | None]:
    """(whether the kernel log could be read, its line saying the OOM killer killed `pid`).

    `since` (seconds since the epoch: when that process started) leaves out the lines logged
    before it, of an older process that had the same pid."""
    records: list[str] = []
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False, None
    try:
        total = 0
        while total < KMSG_LIMIT:
            try:
                record = os.read(fd, 8192)  # /dev/kmsg gives one record per read
            except BlockingIOError:
                break  # the end of the log
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while reading: go on
                    continue
                break
            if not record:
                break
            total += len(record)
            records.append(record.decode("utf-8", "replace"))
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    # The kernel stamps its records with its local clock, microseconds since boot not counting
    # a suspension: CLOCK_MONOTONIC's.
    booted = time.time() - time.monotonic()
    return True, oom_line(records, pid, since=since, booted=booted)


def oom_line(
    records: list[str], pid: int, *, since: float | None = None, booted: float = 0.0
) -> str | None:
    """The kernel log's line saying its OOM killer killed `pid` (`Killed process PID (...)`,
    else its `oom-kill:` summary), among /dev/kmsg records (`prio,seq,usec,flags;message`)
    logged after `since` (seconds since the epoch; the kernel booted at `booted`)."""
    pattern = re.compile(rf"(?:Killed process {pid} \(|oom-kill:.*[,:]pid={pid}(?:[,\s]|$))")
    found: str | None = None
    for record in records:
        head, _, body = record.partition(";")
        message = body.split("\n")[0].strip()
        if since is not None and booted + _stamp_s(head) < since - CLOCK_SLACK_S:
            continue  # an older process with the same pid
        if pattern.search(message) and (found is None or "Killed process" in message):
            found = message
    return found


def _stamp_s(head: str) -> float:
    """A /dev/kmsg record's time (its prefix `priority,seq,microseconds,flags`), in seconds."""
    fields = head.split(",")
    return int(fields[2]) / 1e6 if len(fields) > 2 and fields[2].isdigit() else 0.0


def describe(
    pid: int | None, ray_record: dict[str, Any] | None, kernel: tuple[bool, str | None]
) -> dict[str, str]:
    """`cause` and `reason` of a supervisor's end from Ray's record of its worker (exit type and
    detail, or None) and the kernel log (`kernel_oom_kill`)."""
    readable, oom_line = kernel
    exit_type = str((ray_record or {}).get("exit_type") or "")
    detail = " ".join(str((ray_record or {}).get("exit_detail") or "").split())
    who = f"pid {pid}" if pid is not None else "its process"
    if oom_line:
        return {"cause": "oom_killer", "reason": f"killed by the kernel's OOM killer: {oom_line}"}
    if exit_type == "NODE_OUT_OF_MEMORY":
        return {
            "cause": "ray_memory_monitor",
            "reason": f"killed by Ray's memory monitor: {detail[:300]}",
        }
    if exit_type == "SYSTEM_ERROR":
        if readable:
            return {
                "cause": "signal",
                "reason": f"{who} ended without exiting: killed by a signal (SIGKILL) or a crash "
                "(SIGSEGV, SIGABRT); the kernel log names no OOM kill of it",
            }
        return {
            "cause": "signal_or_oom",
            "reason": f"{who} ended without exiting: killed by a signal (SIGKILL, the kernel's OOM "
            f"killer) or a crash; the kernel log ({KMSG}) could not be read to tell which",
        }
    if exit_type.startswith("INTENDED"):
        return {"cause": "exited", "reason": f"{who} exited ({exit_type}): {detail[:300]}"}
    if exit_type == "USER_ERROR":
        return {"cause": "error", "reason": f"an error in the supervisor: {detail[:300]}"}
    if exit_type:
        return {"cause": exit_type.lower(), "reason": f"Ray says {exit_type}: {detail[:300]}"}
    return {"cause": "unknown", "reason": f"Ray holds no record of the end of {who}"}
