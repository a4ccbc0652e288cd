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
from typing import Any

KMSG = "/dev/kmsg"
# How much of the kernel log is read at most (its ring buffer is far smaller).
KMSG_LIMIT = 16 << 20


def kernel_oom_kill(pid: int, kmsg: str = KMSG) -> tuple[bool, str | None]:
    """(whether the kernel log could be read, its line saying the OOM killer killed `pid`)."""
    pattern = re.compile(rf"(?:Killed process {pid} \(|oom-kill:.*[,:]pid={pid}[,\s])")
    found: str | None = None
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False, None
    try:
        total = 0
        while total < KMSG_LIMIT:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break  # the end of the log
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while reading: go on
                    continue
                return found is not None, found
            if not record:
                break
            total += len(record)
            message = record.decode("utf-8", "replace").partition(";")[2].split("\n")[0]
            if pattern.search(message) and (found is None or "Killed process" in message):
                found = message.strip()
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return True, found


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
