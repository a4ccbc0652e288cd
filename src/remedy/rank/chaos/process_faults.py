"""Process-level chaos faults: a hung rank, a killed rank or node, a slow collective, a full disk.

`hang_rank` stops the rank's own process (SIGSTOP: it answers nothing, as a
rank wedged in a driver call or a stuck collective), `kill_rank` kills it
(SIGKILL), `slow_collective` sleeps after the backward, so the peers wait
for the rank at its next collective. Each fires once per *run*, not per
process (`FaultInjector.fire_once` marks it in the run directory before it
acts): the replacement of a killed rank replays the same step and must not
fire again. `kill_node` SIGKILLs the Ray node the rank runs on: its raylet
(the rank process's ancestor) and every process below the raylet (the
node's workers and agents), this rank's own process last, as a node losing
power.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path


def hang() -> None:
    """Stop this process (SIGSTOP) until someone kills or continues it."""
    os.kill(os.getpid(), signal.SIGSTOP)


def kill() -> None:
    """Kill this process (SIGKILL): no handler, no flush, as a node losing power."""
    os.kill(os.getpid(), signal.SIGKILL)


def _parent_and_name(pid: int) -> tuple[int, str] | None:
    """(parent pid, command name) of `pid` from /proc, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    return int(stat[stat.rindex(")") + 2 :].split()[1]), name


def raylet_of(pid: int) -> int | None:
    """The raylet among `pid`'s ancestors (the process that started this Ray worker), or None."""
    seen = _parent_and_name(pid)
    while seen is not None and seen[0] > 1:
        parent = seen[0]
        seen = _parent_and_name(parent)
        if seen is not None and seen[1] == "raylet":
            return parent
    return None


def tree(root: int) -> list[int]:
    """`root` and every live process below it, `root` first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            seen = _parent_and_name(int(entry.name))
            if seen is not None:
                children.setdefault(seen[0], []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def node_pids() -> list[int]:
    """The pids `kill_node` would kill: this process's raylet and its whole tree (empty: no raylet)."""
    raylet = raylet_of(os.getpid())
    return tree(raylet) if raylet is not None else []


def kill_node() -> None:
    """SIGKILL this process's Ray node: its raylet, every process below it, then this one.

    Raises `ProcessLookupError` (nothing killed) when no raylet is among this
    process's ancestors (a Guard alone, or a worker a raylet did not start).
    """
    pids = node_pids()
    if not pids:
        raise ProcessLookupError("no raylet among this process's ancestors: not a Ray worker")
    me = os.getpid()
    for pid in pids:
        if pid != me:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


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
