"""Every rank restores the same step: agreeing on a restore point across the process group.

A restore that must come from disk (the snapshot ring lacks the step, or a
fresh process resumes) uses the newest step for which *every* rank holds a
checkpoint that passes its checksum. Each rank verifies its own candidates,
the ranks exchange what they found with one `all_gather_object`, and all
take the maximum of the intersection. A checkpoint that fails its checksum
is reported as a `checkpoint_corrupt` anomaly by the Guard, and the
sentence `describe` builds says which step was used and why.

A checkpoint carries, besides the snapshot, the remediations applied so
far and the command bookkeeping (`remediations`), so that `resume` brings
a fresh process (a full-group restart) to the state the run had there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch.distributed as dist

from remedy.rank.exceptions import CheckpointError
from remedy.rank.state import train_state
from remedy.rank.state.checkpoint_store import CheckpointStore

if TYPE_CHECKING:
    from remedy.rank.guard import Guard

log = structlog.get_logger("remedy.restore_point")


@dataclass
class Views:
    """What each rank of the group offered, indexed by rank."""

    values: list[Any]


def gather(value: Any, group: Any = None) -> Views:
    """Every rank's `value`, on every rank (just this one without a process group)."""
    if group is None or not dist.is_initialized():
        return Views([value])
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return Views(out)


def failed_elsewhere(failure: str | None, group: Any = None) -> str:
    """Every rank's failure to restore, exchanged: why the other ranks failed ("" if none did).

    Called by every rank of the group together (one `all_gather_object`) between
    loading a rank's own state and the rest of a restore, so that a rank whose
    objects refused their state is never the only one left at the old step.
    """
    views = gather(failure, group).values
    me = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
    return "; ".join(
        f"rank {rank} could not restore: {why}"
        for rank, why in enumerate(views)
        if why is not None and rank != me
    )


@dataclass
class DiskChoice:
    """The step every rank restores from disk, and why."""

    step: int | None
    corrupt: dict[int, list[int]] = field(default_factory=dict)  # rank -> steps failing checksums
    offered: list[list[int]] = field(default_factory=list)  # each rank's verified steps

    def describe(self) -> str:
        """Why this step: empty when nothing was corrupt and the newest candidate was used."""
        if not self.corrupt:
            return ""
        bad = "; ".join(
            f"step {', '.join(map(str, steps))} failed its checksum on rank {rank}"
            for rank, steps in sorted(self.corrupt.items())
        )
        if self.step is None:
            return f"{bad}: no step is good on every rank"
        return f"{bad}, so every rank used step {self.step}, the newest good on every rank"


def agree_on_disk(
    store: CheckpointStore | None, *, at_or_before: int | None, group: Any = None, older: int = 0
) -> DiskChoice:
    """Every rank calls this: the newest step at or before `at_or_before` good on every rank
    (`older` > 0: the one that many good steps before it, none if there are not so many)."""
    corrupt: list[int] = []
    if store is None:
        good: list[int] = []
    else:
        before = store.on_corrupt

        def note(step: int, error: str) -> None:
            corrupt.append(step)
            if before is not None:
                before(step, error)

        store.on_corrupt = note
        try:
            good = store.verified_steps(at_or_before=at_or_before)
        finally:
            store.on_corrupt = before
    views = gather({"good": good, "corrupt": corrupt}, group)
    offered = [list(v["good"]) for v in views.values]
    common = set(offered[0]).intersection(*offered[1:]) if offered else set()
    newest_first = sorted(common, reverse=True)
    return DiskChoice(
        step=newest_first[older] if len(newest_first) > older else None,
        corrupt={r: list(v["corrupt"]) for r, v in enumerate(views.values) if v["corrupt"]},
        offered=offered,
    )


def remediations(guard: Guard) -> dict[str, Any]:
    """The remediations in force and the command bookkeeping, for a checkpoint's `extra`.

    Commands queued but not yet applied are left out: the supervisor sends
    every command still pending again to the ranks that resume.
    """
    return {
        "skipped": sorted(guard.cursor.skipped),
        **guard.remediation.state(guard.model),
        **guard.inbox.state(with_queued=False),
    }


def resume(guard: Guard, step: int) -> dict[str, Any]:
    """Every rank calls this before its first step: continue from checkpoint `step`.

    Falls back to the newest older step good on every rank when a checkpoint
    fails its checksum; with none good on every rank, the process keeps the
    initial state it built (every rank is fresh: the same start) and every
    checkpoint is retired. Returns what was resumed, for the rank's summary.
    Checkpoints newer than the step used are retired.
    """
    if guard.checkpoints is None:
        raise CheckpointError(
            f"asked to resume from step {step}, but this rank writes no checkpoints "
            "(checkpoint_every is 0 or there is no run directory)"
        )
    choice = agree_on_disk(guard.checkpoints, at_or_before=step, group=guard.group)
    if choice.step is None:
        why = choice.describe() or f"no checkpoint at or before step {step} on every rank"
        out = {
            "requested_step": step,
            "step": 0,
            "why": f"{why}: starting from the initial state",
            "retired": guard.checkpoints.retire_after(-1),
        }
        log.warning("resumed", rank=guard.rank, **out)
        return out
    snap = guard.checkpoints.load(choice.step)
    extra = dict(snap.extra)
    current = remediations(guard)
    state = {
        **current,
        **{k: v for k, v in extra.items() if k in current},
        "snapshot": snap,
        "queued": [],
    }
    train_state.adopt(guard, state, own=True)  # this rank's own checkpoint
    retired = guard.checkpoints.retire_after(snap.step)
    out = {"requested_step": step, "step": snap.step, "why": choice.describe(), "retired": retired}
    log.info("resumed", rank=guard.rank, **out)
    return out
