"""Where this machine's runs can be reached: one small file per live run.

A run on a private embedded Ray is invisible to Ray's discovery by design
(see `remedy.supervisor.cluster`), so `remedy status` and `remedy policy
apply` find it here: its address and, for a private Ray, its token. The
files are readable by their owner only, like `~/.ray/auth_token`.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

# Where the entries live; the environment variable wins over ~/.remedy/runs.
HOME_ENV = "REMEDY_HOME"


def registry_dir() -> Path:
    base = os.environ.get(HOME_ENV) or str(Path.home() / ".remedy")
    return Path(base) / "runs"


def _entry_path(run_id: str) -> Path:
    return registry_dir() / f"{run_id}.json"


def register(run_id: str, record: dict[str, Any]) -> None:
    """Record a live run; best effort (a read-only home only loses `status`/`apply` by id)."""
    path = _entry_path(run_id)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"run_id": run_id, "pid": os.getpid(), **record}, fh)
        os.replace(tmp, path)


def unregister(run_id: str) -> None:
    with contextlib.suppress(OSError):
        _entry_path(run_id).unlink()


def lookup(run_id: str) -> dict[str, Any] | None:
    """The entry of a live run, or None (an entry whose process is gone is removed)."""
    if not run_id or "/" in run_id or run_id.startswith("."):
        return None
    return _read(_entry_path(run_id))


def live_runs() -> list[dict[str, Any]]:
    """Every live run's entry, oldest run id first."""
    try:
        paths = sorted(registry_dir().glob("*.json"))
    except OSError:
        return []
    return [e for e in (_read(p) for p in paths) if e is not None]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("pid"), int):
        return None
    if not _alive(entry["pid"]):
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return entry


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True
