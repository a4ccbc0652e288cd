"""Which chaos faults have fired in this run, kept in the run directory.

A fault fires once per *run*, not per process: a replacement rank started
after `kill_rank` must not be killed again at the same step, and the batches
a `loss_spike` poisoned stay poisoned in the new process (they are a
property of the data). Each fired fault leaves one small JSON marker file,
`RUN_DIR/chaos/fired/<key>.json`, written atomically before the fault acts;
a rank reads the markers when it starts. With no run directory the record
lives in memory and lasts as long as the process.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


class FiredRecord:
    """Markers of fired faults, by key; shared by every process of a run through `path`."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._seen: dict[str, dict[str, Any]] = {}

    def get(self, key: str) -> dict[str, Any] | None:
        """What was recorded when `key` fired (maybe by another process), or None if it has not."""
        if key in self._seen:
            return self._seen[key]
        if self.path is None:
            return None
        try:
            data = json.loads((self.path / f"{key}.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            data = {}  # a marker that cannot be read still says the fault fired
        self._seen[key] = data if isinstance(data, dict) else {}
        return self._seen[key]

    def mark(self, key: str, data: dict[str, Any]) -> None:
        """Record that `key` fired, on disk before this returns (the fault may end the process)."""
        self._seen[key] = data
        if self.path is None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{key}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path / f"{key}.json")
        with contextlib.suppress(OSError):  # the directory entry, for a crash right after
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def fired_dir(run_dir: str | os.PathLike[str] | None) -> Path | None:
    """Where a run keeps its fired-fault markers (None: no run directory, keep them in memory)."""
    return None if run_dir is None else Path(run_dir) / "chaos" / "fired"
