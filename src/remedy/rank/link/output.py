"""The ranks' own output, forwarded to whoever watches the run.

A rank actor's stdout and stderr go to Ray's log files, which `remedy run`
does not stream. `forward_output` tees both streams while the training
function runs: every line still reaches the process's own stream (so Ray's
logs and `ray logs` keep it), and complete lines are sent to the supervisor
in small batches from a helper thread, so a `print()` never waits on Ray.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

# How often buffered lines go out; a line is also sent when the buffer fills.
FLUSH_EVERY_S = 0.2
MAX_BUFFERED = 200
# Longer lines are cut: one runaway print must not flood the supervisor.
MAX_LINE_CHARS = 4000

Sink = Callable[[list[dict[str, Any]]], None]


class _Tee:
    """A text stream that writes through and hands complete lines to a collector."""

    def __init__(self, inner: TextIO, name: str, collect: Callable[[str, str], None]) -> None:
        self._inner = inner
        self._name = name
        self._collect = collect
        self._partial = ""

    def write(self, text: str) -> int:
        n = self._inner.write(text)
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self._collect(self._name, line)
        return n

    def flush(self) -> None:
        self._inner.flush()

    def close_partial(self) -> None:
        if self._partial:
            self._collect(self._name, self._partial)
            self._partial = ""

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._inner, name)


class LineForwarder:
    """Collects lines from any thread; a daemon thread sends them to `sink` in batches."""

    def __init__(self, rank: int, sink: Sink) -> None:
        self.rank = rank
        self._sink = sink
        self._lines: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="remedy-output", daemon=True)
        self._thread.start()

    def collect(self, stream: str, line: str) -> None:
        with self._lock:
            self._lines.append(
                {
                    "rank": self.rank,
                    "stream": stream,
                    "line": line[:MAX_LINE_CHARS],
                    "ts": time.time(),
                }
            )
            full = len(self._lines) >= MAX_BUFFERED
        if full:
            self._wake.set()

    def _take(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self._lines = self._lines, []
        return out

    def _loop(self) -> None:
        while not self._stop:
            self._wake.wait(FLUSH_EVERY_S)
            self._wake.clear()
            self._send()

    def _send(self) -> None:
        lines = self._take()
        if lines:
            with contextlib.suppress(Exception):  # output is best effort; training goes on
                self._sink(lines)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=2.0)
        self._send()


@contextlib.contextmanager
def forward_output(rank: int, sink: Sink) -> Iterator[LineForwarder]:
    """Tee this process's stdout and stderr to `sink` (line batches) until the block ends."""
    forwarder = LineForwarder(rank, sink)
    out, err = sys.stdout, sys.stderr
    tee_out, tee_err = (
        _Tee(out, "stdout", forwarder.collect),
        _Tee(err, "stderr", forwarder.collect),
    )
    sys.stdout, sys.stderr = tee_out, tee_err
    try:
        yield forwarder
    finally:
        sys.stdout, sys.stderr = out, err
        tee_out.close_partial()
        tee_err.close_partial()
        forwarder.close()


def supervisor_sink(supervisor: Any) -> Sink:
    """Send line batches to the supervisor actor's `output` method, without waiting."""

    def send(lines: list[dict[str, Any]]) -> None:
        supervisor.output.remote(lines)

    return send
