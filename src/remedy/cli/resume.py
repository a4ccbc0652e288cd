"""`remedy run --resume-from RUN_DIR`: a new run that starts from another run's newest checkpoint.

The user story is a job restarted on other nodes, often fewer of them. The
new run has a run directory of its own: its `checkpoints/` is seeded with
the source run's checkpoints as hard links (copies across file systems),
so the source directory is never written, and every rank's Guard resumes
from the newest of them before its first step (`restore_point.resume`: the
ranks agree on it, verify its checksums and fall back to an older seeded
one if a file fails).

Which checkpoints a run of W ranks can resume from:

- a sharded (DCP) checkpoint committed by every rank that wrote it, written
  by at least W ranks: DCP reshards the model and optimizer onto the new
  mesh, and new rank r continues from writer r's data position, RNG and
  remediations;
- a plain checkpoint (each rank holds the whole model) committed by ranks
  0..W-1.

A world larger than the writers' is refused: the added ranks would have no
data position or RNG to continue from.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remedy.protocol.exceptions import UsageError
from remedy.rank.state.checkpoint_store import _step_of, committed_manifests


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts: `step` of `source`, written by `writers` ranks."""

    source: Path
    step: int
    writers: int
    steps: tuple[int, ...]  # every step this run can resume from, oldest first (seeded)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.source),
            "step": self.step,
            "writers": self.writers,
            "steps": list(self.steps),
        }


def _writers(manifests: dict[int, dict[str, Any]]) -> int:
    """How many ranks committed a step completely (0: a sharded one some writer did not commit)."""
    if any("world_size" in m for m in manifests.values()):
        # DCP: every writer's files are part of the one checkpoint, whose metadata rank 0 wrote.
        world = manifests.get(0, {}).get("world_size", 0)
        if not isinstance(world, int) or isinstance(world, bool):
            return 0
        return world if all(r in manifests for r in range(world)) else 0
    count = 0
    while count in manifests:  # plain: ranks 0..count-1 each hold the whole model
        count += 1
    return count


def find(source: Path, workers: int, *, given: str) -> ResumePoint:
    """The newest step of `source` that `workers` ranks can resume from; UsageError saying why not."""
    folder = source / "checkpoints"
    if not folder.is_dir():
        raise UsageError(f"{given}: has no checkpoints/ folder (not a remedy run directory?)")
    steps = sorted(
        {s for p in folder.glob("step-*.rank*.json") if (s := _step_of(p.name)) is not None}
    )
    writers = {s: _writers(committed_manifests(folder, s)) for s in steps}
    complete = [s for s in steps if writers[s] > 0]
    if not complete:
        raise UsageError(f"{given}: holds no checkpoint committed by every rank that wrote it")
    newest = complete[-1]
    if writers[newest] < workers:
        raise UsageError(
            f"{given}: its newest checkpoint (step {newest}) was written by {writers[newest]} "
            f"rank(s); a run of {workers} cannot resume from it (the ranks beyond those would "
            f"have no data position or RNG to continue from): use --workers {writers[newest]} "
            "or fewer"
        )
    usable = tuple(s for s in complete if writers[s] >= workers)
    return ResumePoint(source, newest, writers[newest], usable)


def _link(src: Path, dst: Path) -> None:
    """`dst` is `src` as a hard link, or a copy where the file systems differ."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)  # a seed of a start that failed: never copied through a link
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def seed(point: ResumePoint, run_dir: Path) -> None:
    """Give `run_dir/checkpoints` the files of `point`'s steps.

    The stores replace a checkpoint file by renaming a new one over it, and
    DCP shards are unlinked before they are written again (`DcpStore.save`),
    so nothing the new run writes reaches the source's files through a link.
    """
    src, dst = point.source / "checkpoints", run_dir / "checkpoints"
    for step in point.steps:
        for path in src.glob(f"step-{step:08d}.rank*"):
            if path.suffix in (".json", ".pt"):
                _link(path, dst / path.name)
        dcp = src / f"dcp-step-{step:08d}"
        if dcp.is_dir():
            for path in dcp.iterdir():
                if path.is_file() and not path.name.endswith(".tmp"):
                    _link(path, dst / dcp.name / path.name)


def locate(source: str, workers: int) -> ResumePoint:
    """`--resume-from source` for a run of `workers` ranks; UsageError saying why it cannot be."""
    given = f"--resume-from {source}"
    path = Path(source).expanduser().resolve()
    if not path.is_dir():
        raise UsageError(f"{given}: no such directory")
    return find(path, workers, given=given)
