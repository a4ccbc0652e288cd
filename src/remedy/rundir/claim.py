"""Claim a run directory for one `remedy run`, before Ray starts.

The directory must be creatable and writable and hold no earlier run; it is
claimed with an exclusive marker file, so two runs started at once with the
same `--run-dir` cannot both write their journals there. A run that fails to
start gives the claim back, leaving no empty directories behind.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from remedy.protocol.exceptions import UsageError
from remedy.rundir.names import MARKER, RUN_FILES


@dataclass
class Claim:
    path: Path
    created: list[Path] = field(default_factory=list)
    started: bool = False

    def release(self) -> None:
        """Undo the claim of a run that never started: the marker, and the folders made for it."""
        if self.started:
            return
        with contextlib.suppress(OSError):
            (self.path / MARKER).unlink()
        for folder in reversed(self.created):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if still empty


def claim_run_dir(path: Path, *, given: str, run_id: str) -> Claim:
    """Create (if needed) and claim `path`; UsageError naming it as `given` with the reason if not."""
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{given}: exists and is not a directory")
        if path.is_dir():
            held = [name for name in RUN_FILES if (path / name).exists()]
            if held:
                raise UsageError(
                    f"{given}: already holds a run ({held[0]}); choose another directory"
                )
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        claim = Claim(path, created=list(reversed(missing)))
        try:
            fd = os.open(path / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise UsageError(
                f"{given}: another run claimed it just now; choose another directory"
            ) from None
        except OSError:
            claim.release()
            raise
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(run_id + "\n")
        return claim
    except UsageError:
        raise
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise UsageError(f"{given}: cannot create or write it ({reason})") from None


# A supervisor's line in the claim: `supervisor K pid P` as incarnation K starts in process P
# (`control.identity`; the pid is how the next one asks Ray why it died).
SUPERVISOR_LINE = "supervisor "


def note_supervisor(path: Path, incarnation: int, pid: int) -> None:
    """Note in `path`'s claim that supervisor incarnation `incarnation` started in process
    `pid` (fsynced): a count of supervisors that outlives a lost journal.wal."""
    fd = os.open(path / MARKER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{SUPERVISOR_LINE}{incarnation} pid {pid}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def claimed_supervisors(path: Path) -> dict[int, int | None]:
    """Each supervisor incarnation `path`'s claim notes -> its process id (None: not noted)."""
    try:
        text = (path / MARKER).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    out: dict[int, int | None] = {}
    for line in text.splitlines():
        words = line[len(SUPERVISOR_LINE) :].split() if line.startswith(SUPERVISOR_LINE) else []
        if words and words[0].isdigit():
            pid = words[2] if len(words) == 3 and words[1] == "pid" else ""
            out[int(words[0])] = int(pid) if pid.isdigit() else None
    return out


def claimed_lives(path: Path) -> int:
    """The highest supervisor incarnation `path`'s claim notes (0: none, or no claim)."""
    return max(claimed_supervisors(path), default=0)
