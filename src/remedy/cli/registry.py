"""Where this machine's runs can be found again: one small file per run.

`remedy run` records each run it starts in `~/.remedy/runs/<run_id>.json`
(`$REMEDY_HOME` moves it): its run directory, its Ray cluster's address and
namespace, the run's token (without which its supervisor refuses every call)
and, for a private embedded Ray, that Ray's own authentication token. `remedy
status`, `logs`, `stop`, `attach` and `policy apply` read it. The files are
readable by their owner only, like `~/.ray/auth_token`.

An entry outlives its run (a finished run's `status` comes from its run
directory's `summary.json`); `state` is what the starting command last knew
(`running`, or the end status it saw). An entry of a private Ray whose
`remedy run` process is gone without ending it names nothing reachable and
is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

# Where the entries live; the environment variable wins over ~/.remedy/runs.
HOME_ENV = "REMEDY_HOME"
# States a run's entry may end in; a live entry says `running`.
FINAL_STATES = frozenset({"completed", "degraded", "aborted", "failed", "stopped"})


def registry_dir() -> Path:
    base = os.environ.get(HOME_ENV) or str(Path.home() / ".remedy")
    return Path(base) / "runs"


def _entry_path(run_id: str) -> Path:
    return registry_dir() / f"{run_id}.json"


def valid_run_id(run_id: str) -> bool:
    """A run id that can name an entry (nothing path-like)."""
    return (
        bool(run_id) and "/" not in run_id and "\x00" not in run_id and not run_id.startswith(".")
    )


def register(run_id: str, record: dict[str, Any]) -> None:
    """Record a run; best effort (a read-only home only loses finding the run by id)."""
    entry = {"run_id": run_id, "pid": os.getpid(), "state": "running", "started": time.time()}
    _write(run_id, {**entry, **record})


def register_run(spec: Any, conn: Any, *, detached: bool) -> None:
    """Record the run of `spec` (a `RunSpec`) supervised on the Ray `conn` joined
    (`cluster.connect`): how `status`, `logs`, `stop` and `attach` reach it again."""
    from remedy.protocol.spec import NAMESPACE  # noqa: PLC0415

    local = conn.mode == "local"
    register(
        spec.run_id,
        {
            "address": conn.address,
            "namespace": NAMESPACE,
            "token": spec.token,
            # A private Ray's own authentication token (its registry entry is how it is joined).
            "ray_token": conn.token if local else None,
            "mode": "local" if local else "cluster",
            "run_dir": spec.run_dir,
            "temp_dir": conn.temp_dir,
            "detached": detached,
        },
    )


def written_at(run_id: str) -> float:
    """When a run's entry was last written (0 if unknown): the start of an entry without
    `started` (written before entries had it), near enough to order the runs by."""
    try:
        return _entry_path(run_id).stat().st_mtime if valid_run_id(run_id) else 0.0
    except OSError:
        return 0.0


def update(run_id: str, **fields: Any) -> None:
    """Change fields of a run's entry (its end `state`, say); nothing if it has none."""
    entry = lookup(run_id)
    if entry is not None:
        _write(run_id, {**entry, **fields})


def settle(run_id: str, state: str, **fields: Any) -> None:
    """Give the entry of a run whose driver is gone its end `state` (read as it is: `lookup`
    drops a local run's entry whose driver died without one)."""
    if not valid_run_id(run_id):
        return
    with contextlib.suppress(OSError, ValueError):
        entry = json.loads(_entry_path(run_id).read_text(encoding="utf-8"))
        if isinstance(entry, dict) and entry.get("state") not in FINAL_STATES:
            _write(run_id, {**entry, "state": state, **fields})


def _write(run_id: str, entry: dict[str, Any]) -> None:
    if not valid_run_id(run_id):
        return
    path = _entry_path(run_id)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(entry, fh)
        os.replace(tmp, path)


def unregister(run_id: str) -> None:
    if valid_run_id(run_id):
        with contextlib.suppress(OSError):
            _entry_path(run_id).unlink()


def lookup(run_id: str) -> dict[str, Any] | None:
    """The entry of a run, or None."""
    if not valid_run_id(run_id):
        return None
    return _read(_entry_path(run_id))


def runs() -> list[dict[str, Any]]:
    """Every run's entry, oldest run id first."""
    try:
        paths = sorted(registry_dir().glob("*.json"))
    except OSError:
        return []
    return [e for e in (_read(p) for p in paths) if e is not None]


def live_runs() -> list[dict[str, Any]]:
    """The entries of runs not known to have ended."""
    return [e for e in runs() if e.get("state") not in FINAL_STATES]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("run_id"), str):
        return None
    orphan = (
        entry.get("mode", "local") == "local"
        and entry.get("state") not in FINAL_STATES
        and not (isinstance(entry.get("pid"), int) and _alive(entry["pid"]))
    )
    if orphan:  # its private Ray went with its `remedy run`
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
