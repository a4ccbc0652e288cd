"""The private Ray's watchdog: when the `remedy run` that started it dies, nothing of it stays.

A private Ray's raylet and GCS die with the driver that started them (Ray
starts them with the kernel's parent-death signal), and the workers with
the raylet; but Ray's dashboard and runtime-env agents stay about a minute
(three under load) and the temporary directory stays for good. A driver
that ends normally stops its Ray (`cluster.disconnect`); one that is
SIGKILLed (by a person, a job scheduler, the OOM killer) cannot.

So the driver starts this watchdog with its private Ray: a small process in
a session of its own (a signal to the driver's process group spares it),
that waits on the driver's pid (a pidfd: woken the moment the driver is
gone). When the driver ends without standing it down (`Watchdog.stand_down`,
after a normal stop) it:

1. SIGKILLs every process of that private Ray: those whose environment holds
   the private Ray's own authentication token (`RAY_AUTH_TOKEN`, a random
   secret of that cluster that every Ray process inherits), until none is
   left or `END_BOUND_S` passed;
2. copies the run's Ray logs into its run directory (`rundir.ray_logs`), writes
   its `summary.json` if none was written (status `failed`, the reason
   naming the driver) and marks the run failed in the registry;
3. removes the temporary directory.

The driver sends what it watches as JSON lines on the watchdog's stdin
(never on its command line, which any user can read: the token opens the
cluster): first the cluster, then the run once it is known, then `done`.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from remedy.rundir import jsonl

# How long the watchdog goes on killing the private Ray's processes once the driver is gone.
END_BOUND_S = 10.0
# How long a driver waits for its watchdog to leave after standing it down.
STAND_DOWN_S = 5.0
TOKEN_ENV = "RAY_AUTH_TOKEN"


class Watchdog:
    """The driver's handle on its private Ray's watchdog process."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def _send(self, message: dict[str, Any]) -> None:
        stdin = self.proc.stdin
        if stdin is None or stdin.closed:
            return
        with contextlib.suppress(OSError, ValueError):  # it died: nothing watches any more
            stdin.write((json.dumps(message) + "\n").encode())
            stdin.flush()

    def watch_run(self, run_dir: str, run_id: str, **summary: Any) -> None:
        """The run on that Ray: where its logs go, and whose summary to write, if the driver dies."""
        self._send({"run_dir": run_dir, "run_id": run_id, "summary": summary})

    def stand_down(self) -> None:
        """The driver stopped its Ray itself: the watchdog leaves without doing anything."""
        self._send({"done": True})
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=STAND_DOWN_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=STAND_DOWN_S)


def start(token: str, temp_dir: str) -> Watchdog | None:
    """Start the watchdog of the private Ray with `token` and `temp_dir` (None if it cannot)."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}  # not one of its victims
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "remedy.cli.ray_watchdog", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    except OSError:
        return None
    dog = Watchdog(proc)
    dog._send({"token": token, "temp_dir": temp_dir})
    return dog


def processes_with(token: str, *, skip: int | None = None) -> list[int]:
    """The pids whose environment holds `RAY_AUTH_TOKEN=token` (the private Ray's processes)."""
    needle = f"{TOKEN_ENV}={token}".encode()
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == skip:
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:  # gone, or another user's
                continue
            if needle in environ.split(b"\0"):
                found.append(int(entry))
    return found


def end_processes(token: str, bound_s: float = END_BOUND_S) -> list[int]:
    """SIGKILL every process of the private Ray with `token` until none is left or `bound_s`
    passed; the pids still there at the bound (none, normally)."""
    deadline = time.monotonic() + bound_s
    while True:
        left = processes_with(token, skip=os.getpid())
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _wait_for_driver(driver: int, inbox: IO[bytes], watched: dict[str, Any]) -> bool:
    """Read the driver's messages into `watched` until it stands the watchdog down (False) or
    ends without doing so (True)."""
    try:
        pidfd: int | None = os.pidfd_open(driver)
    except OSError:  # no pidfd (an old kernel, or the driver is gone): poll the pid
        pidfd = None
    reader = _Inbox(inbox.fileno(), watched)
    while os.getppid() == driver:  # re-parented: the driver is gone
        fds = [fd for fd in (pidfd, reader.fd if reader.open else None) if fd is not None]
        ready, _, _ = select.select(fds, [], [], 1.0 if pidfd is None else None)
        if pidfd is not None and pidfd in ready:
            break
        if reader.fd in ready and reader.read():
            return False
    # What the driver sent before it died is still in the pipe: read it all.
    while reader.open and select.select([reader.fd], [], [], 0)[0]:
        if reader.read():
            return False
    return True


class _Inbox:
    """The driver's JSON lines on the watchdog's stdin."""

    def __init__(self, fd: int, watched: dict[str, Any]) -> None:
        self.fd, self.watched = fd, watched
        self.open = True
        self._buffer = b""

    def read(self) -> bool:
        """Take what is there into `watched`; True once the driver said `done`."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.open = False  # the driver's end closed: its death comes next
            return False
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for message in jsonl.scan(lines, "the driver's messages"):
            if isinstance(message, dict):  # a damaged line is dropped
                if message.get("done"):
                    return True
                self.watched.update(message)
        return False


def clean_up(driver: int, watched: dict[str, Any]) -> None:
    """The driver died with its private Ray running: end it, keep the run's logs, say why."""
    token, temp_dir = watched.get("token"), watched.get("temp_dir")
    if isinstance(token, str) and token:
        end_processes(token)
    run_dir, run_id = watched.get("run_dir"), watched.get("run_id")
    if isinstance(temp_dir, str) and isinstance(run_dir, str):
        from remedy.rundir.ray_logs import keep_logs  # noqa: PLC0415

        keep_logs(temp_dir, run_dir)
    if isinstance(temp_dir, str):
        shutil.rmtree(temp_dir, ignore_errors=True)
    if isinstance(run_dir, str) and isinstance(run_id, str):
        _mark_failed(driver, run_dir, run_id, watched.get("summary") or {})


def _mark_failed(driver: int, run_dir: str, run_id: str, extra: dict[str, Any]) -> None:
    from remedy.cli import registry  # noqa: PLC0415 - only after the driver died
    from remedy.rundir.rundata import write_fallback_summary  # noqa: PLC0415

    reason = (
        f"the driver of remedy run (pid {driver}) ended without ending the run (killed); "
        "its private Ray was ended by remedy's watchdog"
    )
    with contextlib.suppress(Exception):  # a summary that cannot be written: the logs say why
        write_fallback_summary(run_dir, run_id, reason, **extra)
    registry.settle(run_id, "failed", ray_token=None)


def main() -> int:
    """The watchdog process: watch the parent (the driver) until it stands down or dies."""
    driver = int(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the driver's to handle
    watched: dict[str, Any] = {}
    if _wait_for_driver(driver, sys.stdin.buffer, watched):
        clean_up(driver, watched)
    return 0


if __name__ == "__main__":
    sys.exit(main())
