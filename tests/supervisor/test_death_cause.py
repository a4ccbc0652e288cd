"""How a supervisor died, in a word and a sentence (`supervisor.death_cause`): Ray's record of its
worker and the kernel log's OOM kills told apart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from remedy.supervisor.death_cause import describe, kernel_oom_kill, oom_line

UNEXPECTED = {"exit_type": "SYSTEM_ERROR", "exit_detail": "Worker unexpectedly exits with a "
              "connection error code 2. End of file. Some common causes include: (1) the "
              "process was killed by the OOM killer ..."}  # fmt: skip
RAY_OOM = {"exit_type": "NODE_OUT_OF_MEMORY", "exit_detail": "Task was killed: low memory."}
EXITED = {"exit_type": "INTENDED_USER_EXIT", "exit_detail": "exit_actor"}
OOM_LINE = "Memory cgroup out of memory: Killed process 42 (ray::SupervisorA) total-vm:1kB"


@pytest.mark.parametrize(
    ("record", "kernel", "cause", "words"),
    [
        (UNEXPECTED, (True, OOM_LINE), "oom_killer", "killed by the kernel's OOM killer: Memory"),
        (UNEXPECTED, (True, None), "signal", "killed by a signal (SIGKILL) or a crash"),
        (UNEXPECTED, (False, None), "signal_or_oom", "could not be read to tell which"),
        (RAY_OOM, (True, None), "ray_memory_monitor", "Ray's memory monitor"),
        (EXITED, (True, None), "exited", "pid 42 exited (INTENDED_USER_EXIT): exit_actor"),
        ({"exit_type": "USER_ERROR", "exit_detail": "KeyError"}, (True, None), "error", "KeyError"),
        (None, (True, None), "unknown", "Ray holds no record of the end of pid 42"),
    ],
)
def test_each_end_has_its_cause(
    record: dict[str, str] | None, kernel: tuple[bool, str | None], cause: str, words: str
) -> None:
    """describe: the kernel's OOM line wins; else Ray's exit type, and whether the log was read."""
    said = describe(42, record, kernel)
    assert said["cause"] == cause
    assert words in said["reason"], said


def test_an_unreadable_kernel_log_is_said_so(tmp_path: Path) -> None:
    """kernel_oom_kill of a log that cannot be opened: not readable, no line."""
    assert kernel_oom_kill(42, str(tmp_path / "no-kmsg")) == (False, None)


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="the kernel log is not readable")
def test_a_living_process_has_no_oom_kill_in_the_kernel_log() -> None:
    """The real /dev/kmsg read to its end: readable, and no OOM kill of this test's own pid."""
    assert kernel_oom_kill(os.getpid()) == (True, None)


def test_the_kernels_line_for_that_process_is_found() -> None:
    """oom_line: the `Killed process` line of that pid (over its `oom-kill:` summary), not another
    pid's, not one logged before the process started (an older process with the same pid)."""
    records = [
        "6,100,1000000,-;oom-kill:constraint=CONSTRAINT_MEMCG,task=ray::Supervisor,pid=42,uid=0",
        "3,101,1000100,-;Memory cgroup out of memory: Killed process 42 (ray::Supervisor) x\n X=y",
        "3,102,1000200,-;Memory cgroup out of memory: Killed process 420 (python) total-vm:1kB",
    ]
    found = oom_line(records, 42)
    assert found == "Memory cgroup out of memory: Killed process 42 (ray::Supervisor) x"
    assert oom_line(records[:1], 42) == records[0].partition(";")[2]
    assert oom_line(records[2:], 42) is None
    # Booted at 1000 (epoch seconds): the lines are from 1001.0-1001.2.
    assert oom_line(records, 42, since=1001.0, booted=1000.0) == found
    assert oom_line(records, 42, since=2000.0, booted=1000.0) is None
