"""A run directory that cannot be written: a full disk, a read-only or deleted directory.

The supervisor's own files are how a run is resumed and explained, so the
first write that fails ends the run: `RunDirWriteError` names the file and
the cause in one line (`runs/x/journal.wal: No space left on device
(ENOSPC)`), and the summary goes where it can (`fallback_dir`, printed by
`remedy run`). `remedy run` exits `EXIT_RUN_DIR` for it.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

# Where a run's summary goes when its run directory cannot take it; the variable wins
# over the system's temporary directory.
FALLBACK_DIR_ENV = "REMEDY_FALLBACK_DIR"


class RunDirWriteError(OSError):
    """A write to a run directory's file failed: `path`, and the OSError's cause."""

    def __init__(self, path: str | os.PathLike[str], cause: OSError | str) -> None:
        if isinstance(cause, OSError):
            code = cause.errno
            why = cause.strerror or str(cause)
        else:
            code, why = None, cause
        name = errno.errorcode.get(code, "") if code is not None else ""
        self.path = str(path)
        self.line = f"{self.path}: {why}" + (f" ({name})" if name else "")
        super().__init__(code, why, self.path)

    def __str__(self) -> str:
        return self.line

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        # Crosses the supervisor actor's boundary as its one line.
        return (_rebuilt, (self.path, self.line))


def _rebuilt(path: str, line: str) -> RunDirWriteError:
    out = RunDirWriteError(path, line)
    out.line = line
    return out


def gone(path: str | os.PathLike[str]) -> RunDirWriteError | None:
    """The error for a run directory deleted under the run (None while it is there)."""
    if os.path.isdir(path):
        return None
    return RunDirWriteError(path, OSError(errno.ENOENT, "the run directory was deleted"))


def fallback_dir(run_id: str) -> Path:
    """Where `run_id`'s summary goes when its run directory cannot be written."""
    base = os.environ.get(FALLBACK_DIR_ENV) or tempfile.gettempdir()
    return Path(base) / f"remedy-{run_id}"
