"""Whether a launched group is its launcher's restart of a run, told from the run directory.

torchrun tells its workers which attempt they are (`TORCHELASTIC_RESTART_COUNT`,
`launcher.restart_count`). Ray Train 2.60 tells them nothing: its
`FailureConfig(max_failures=N)` counts the failures in the controller, the run
attempt's id is a fresh uuid the workers never see, and `ray.train.get_checkpoint()`
is set only for checkpoints the loop reported to Ray itself. So a Ray Train rank
decides from the run directory, which every rank of every attempt shares:

- each rank's Guard notes its start in `attempt-rank-<r>.json` (the attempt number);
- a start that finds its rank's note and no finished run there (no `summary.json`,
  or one whose status is `failed`, as rank 0 writes it when a peer was lost) is a
  restart of that run: attempt = the noted one + 1. It then resumes from the newest
  checkpoint every rank committed (`launcher.resume_step`), as torchrun's restart does.

Every rank reads the same directory before its first step (no rank writes a
checkpoint before every rank has started: a step needs all of them), so every rank
of a restarted group comes to the same answer. A run directory left by a run that
crashed and is started again by hand counts as a restart of it too: it resumes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from remedy.rank.link.context import WorkerContext

# A launcher that tells its workers nothing about restarts: decided from the run directory.
FROM_RUN_DIR = ("Ray Train",)
# What rank 0 writes as summary.json when a peer was lost (`group_decide`): not finished.
UNFINISHED = ("failed",)


def marker(run_dir: Path, rank: int) -> Path:
    """This rank's note of its latest start in `run_dir`."""
    return run_dir / f"attempt-rank-{rank}.json"


def noted_attempt(run_dir: Path, rank: int) -> int | None:
    """The attempt this rank last started in `run_dir`, or None (never, or unreadable)."""
    try:
        value = json.loads(marker(run_dir, rank).read_text()).get("attempt")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value >= 0 else None


def finished(run_dir: Path) -> bool:
    """True when `run_dir` holds a run that ended (a summary whose status is not `failed`)."""
    try:
        status = json.loads((run_dir / "summary.json").read_text()).get("status")
    except FileNotFoundError:
        return False
    except (OSError, ValueError, AttributeError):
        return True  # a summary nobody can read: not this run's to resume
    return status not in UNFINISHED


def attempt_in(run_dir: Path, rank: int) -> int:
    """Which attempt of the run in `run_dir` this start is (0: the first), and note it."""
    before = noted_attempt(run_dir, rank)
    attempt = before + 1 if before is not None and not finished(run_dir) else 0
    run_dir.mkdir(parents=True, exist_ok=True)
    path = marker(run_dir, rank)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"attempt": attempt, "pid": os.getpid()}) + "\n")
    os.replace(tmp, path)
    return attempt


def note_start(ctx: WorkerContext) -> None:
    """A launched rank whose Guard has its run directory: under a launcher that says nothing
    of restarts, decide from the directory, and give a restart its own decision ids."""
    if ctx.launcher not in FROM_RUN_DIR or ctx.run_dir is None:
        return
    ctx.attempt = attempt_in(ctx.run_dir, ctx.rank)
    if ctx.attempt:
        # The new attempt's controller counts decisions from 1 again: ids of their own.
        ctx.run_id = f"{ctx.run_id}-restart{ctx.attempt}"
