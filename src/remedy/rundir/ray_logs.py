"""Keep the private Ray's logs of a run that failed, or whose supervisor died, in its run directory.

A private Ray (`remedy run --address local`) writes its logs under its own
temporary directory, which is removed when the run ends. What explains a
failure is often only there: the supervisor's traceback in its worker's
stderr, a rank's, the raylet's view of a worker that died. Before that
directory is removed, `keep_logs` copies the logs that matter into
`<run_dir>/logs/`, bounded in size:

- which: the workers' stdout and stderr (`worker-*.out`, `worker-*.err`, each
  named by Ray by worker id, job and pid; Ray's first lines say which actor
  class ran there) and their core-worker logs (`python-core-worker-*.log`),
  then the raylet's and the GCS's (`raylet.out`, `raylet.err`,
  `gcs_server.out`, `gcs_server.err`). The supervisor's come first, then
  the ranks', then Ray's own, then any other worker's (spares, node agents).
- how much: the last `PER_FILE_BYTES` (1 MiB) of each file, and at most
  `TOTAL_BYTES` (32 MiB) in all; a file cut at its start says so in its
  first line, and files left out by the total cap are named in the index.
- `logs/index.json`: one entry per file, with what ran there (`role`:
  `supervisor`, `rank`, ..., `ray`), its pid, its size, how much was kept.

Pure standard library: the watchdog (`cli.ray_watchdog`) calls it too,
after the driver itself died.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from remedy.rundir import jsonl, names

# The tail of each log file kept (a long run's log is mostly its healthy past).
PER_FILE_BYTES = 1 << 20
# All the logs kept for one run, at most.
TOTAL_BYTES = 32 << 20
LOGS_DIR = names.LOGS
INDEX = "index.json"
DAEMON_LOGS = ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err")
# Ray's worker log names: worker-<worker id>-<job id>-<pid>.out|.err, and the core worker's.
_WORKER = re.compile(r"^worker-[0-9a-f]+-[0-9a-f]+-(\d+)\.(out|err)$")
_CORE = re.compile(r"^python-core-worker-[0-9a-f]+_(\d+)\.log$")
# The line Ray writes at the top of a worker's out/err once an actor runs there.
_ACTOR = re.compile(r"^:actor_name:(\S+)", re.MULTILINE)
# What each of remedy's actor classes is, for the index; other classes are `worker`.
ROLES = {
    "SupervisorActor": "supervisor",
    "RankActor": "rank",
    "NodeAgent": "node_agent",
}
_ORDER = ("supervisor", "rank", "ray", "node_agent", "worker")


@dataclass
class KeptLog:
    """One log file of the private Ray, and what of it the run directory kept."""

    name: str
    role: str
    pid: int | None
    size: int
    kept: int = 0
    left_out: str | None = None  # why nothing was kept


def session_logs(temp_dir: str | Path) -> list[Path]:
    """The logs folders of a private Ray's temporary directory (one per Ray session)."""
    root = Path(temp_dir)
    with contextlib.suppress(OSError):
        return sorted(p / "logs" for p in root.iterdir() if p.name.startswith("session_2"))
    return []


def _actor_class(path: Path) -> str | None:
    with contextlib.suppress(OSError), path.open("rb") as f:
        found = _ACTOR.search(f.read(4096).decode("utf-8", "replace"))
        return found.group(1) if found else None
    return None


def survey(logs: Path) -> list[KeptLog]:
    """The files of one Ray logs folder worth keeping, most telling first (nothing copied)."""
    try:
        names = sorted(os.listdir(logs))
    except OSError:
        return []
    role_of_pid: dict[int, str] = {}
    found: list[KeptLog] = []
    for name in names:
        match = _WORKER.match(name)
        if match is not None:
            pid = int(match.group(1))
            cls = _actor_class(logs / name)
            role = ROLES.get(cls or "", "worker")
            if role != "worker" or pid not in role_of_pid:
                role_of_pid[pid] = role
            found.append(KeptLog(name, role, pid, _size(logs / name)))
        elif name in DAEMON_LOGS:
            found.append(KeptLog(name, "ray", None, _size(logs / name)))
    for name in names:
        match = _CORE.match(name)
        if match is not None:
            pid = int(match.group(1))
            found.append(KeptLog(name, role_of_pid.get(pid, "worker"), pid, _size(logs / name)))
    for log in found:  # a worker's out and err share the role Ray's marker gave either
        if log.pid is not None and log.role == "worker":
            log.role = role_of_pid.get(log.pid, "worker")
    found = [log for log in found if log.size > 0]
    found.sort(key=lambda log: (_ORDER.index(log.role), log.pid or 0, log.name))
    return found


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def keep_logs(
    temp_dir: str | Path,
    run_dir: str | Path,
    *,
    per_file: int = PER_FILE_BYTES,
    total: int = TOTAL_BYTES,
) -> Path | None:
    """Copy the private Ray's telling logs into `<run_dir>/logs/` (bounded); the folder, or
    None where there was nothing to copy or it could not be written."""
    dest = Path(run_dir) / LOGS_DIR
    budget = total
    index: list[dict[str, Any]] = []
    for logs in session_logs(temp_dir):
        for log in survey(logs):
            want = min(log.size, per_file)
            if want > budget:
                log.left_out = f"over the {total} bytes kept in all"
            else:
                try:
                    dest.mkdir(parents=True, exist_ok=True)
                    log.kept = _copy_tail(logs / log.name, dest / log.name, want, log.size)
                except OSError as exc:
                    log.left_out = f"not copied: {exc.strerror or exc}"
                budget -= log.kept
            index.append({"session": logs.parent.name, **asdict(log)})
    if not index:
        return None
    try:
        dest.mkdir(parents=True, exist_ok=True)
        text = json.dumps(
            {"per_file_bytes": per_file, "total_bytes": total, "files": index}, indent=1
        )
        (dest / INDEX).write_text(text + "\n", encoding="utf-8")
    except OSError:
        return None
    return dest


def _copy_tail(src: Path, dst: Path, want: int, size: int) -> int:
    """The last `want` bytes of `src` into `dst` (a note first if its start was cut)."""
    with src.open("rb") as f:
        if size > want:
            f.seek(size - want)
        data = f.read(want)
    with dst.open("wb") as out:
        if size > len(data):
            out.write(f"[remedy: the first {size - len(data)} bytes of {size} left out]\n".encode())
        out.write(data)
    return len(data)


def read_index(run_dir: str | Path) -> list[dict[str, Any]]:
    """`logs/index.json` of a run directory: the files kept (empty if none were)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        files = json.loads((Path(run_dir) / LOGS_DIR / INDEX).read_text(encoding="utf-8"))["files"]
        return [f for f in files if isinstance(f, dict)]
    return []


def wants_logs(run_dir: str | Path) -> bool:
    """Whether a run's logs explain something: it failed (or wrote no summary), or a supervisor
    of it died (`supervisor_died` in its history)."""
    path = Path(run_dir)
    try:
        summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True
    if not isinstance(summary, dict) or summary.get("status") == "failed":
        return True
    with contextlib.suppress(OSError):
        history = jsonl.records(path / "history.jsonl")
        return any(r.get("type") == "supervisor_died" for r in history)
    return False
