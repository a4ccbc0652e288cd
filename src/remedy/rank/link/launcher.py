"""A rank that a launcher started, not remedy: torchrun, Ray Train, a plain `mp.spawn`.

When `torch.distributed` is initialised with several ranks and no remedy
supervisor set a context, the process was started by someone else's
launcher. `detect` then gives the rank a `WorkerContext` of its own (its
real rank and the world size, so the README's DDP loop shards its data the
same way under torchrun as under `remedy run`), and the Guard decides once
for the group (`group_decide`).

What such a rank gets besides: the chaos faults of the file `REMEDY_CHAOS`
names, and, when torchrun's elastic agent restarts the group
(`TORCHELASTIC_RESTART_COUNT` > 0) or Ray Train starts it again (told from
the run directory, `relaunch`), a resume from the newest checkpoint every rank
committed, by the path `remedy run --resume-from` takes (`restore_point.resume`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from remedy.rank.link.context import WorkerContext

# The file of chaos faults a launched rank injects (`remedy run --chaos` is the supervisor's).
CHAOS_ENV = "REMEDY_CHAOS"
# torchrun's count of restarts of the group by its elastic agent (`--max-restarts N`).
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
# Set by torchrun (and torch.distributed.run) in every worker it starts.
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"

# What only a remedy supervisor can do, said once at start on rank 0.
SUPERVISOR_ONLY = (
    "restarting a hung or dead rank from a warm spare, node agents and the hang watch "
    "need `remedy run`"
)


def launcher_name() -> str:
    """Which launcher started this process, as far as it can tell."""
    if os.environ.get(TORCHRUN_ENV):
        return "torchrun"
    if "ray.train" in sys.modules:
        return "Ray Train"
    return "a process group without a supervisor"


def detect() -> WorkerContext | None:
    """This rank's context under a launcher, or None (no process group of several ranks).

    Imports nothing: a process that has not loaded `torch.distributed` has no group.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.get_world_size()
    if world <= 1:
        return None
    ctx = WorkerContext(rank=dist.get_rank(), world_size=world, launcher=launcher_name())
    ctx.attempt = restart_count()
    if ctx.attempt:
        # Decision ids start again in a restarted group's new controller; the ranks resume
        # with the ids done before the restart, so the new ones must differ from them.
        ctx.run_id = f"{ctx.run_id}-restart{ctx.attempt}"
    chaos = os.environ.get(CHAOS_ENV)
    if chaos:
        from remedy.rank.chaos.faults import load_chaos  # noqa: PLC0415 - chaos runs only

        ctx.faults = load_chaos(chaos, world_size=world)
    return ctx


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted the group (0: the first start)."""
    try:
        return max(0, int(os.environ.get(RESTART_ENV, "0")))
    except ValueError:
        return 0


def resume_step(run_dir: Path | None, attempt: int) -> int | None:
    """Where a restarted group (`attempt` > 0) resumes: the newest step any rank checkpointed
    in `run_dir`.

    Every rank then agrees on the newest step that every rank committed and that passes
    its checksums, at or before it (`restore_point.resume`), as `--resume-from` does.
    None on a first start, or with nothing to resume from.
    """
    if attempt == 0 or run_dir is None:
        return None
    from remedy.rank.state.checkpoint_store import _step_of  # noqa: PLC0415

    folder = run_dir / "checkpoints"
    steps = [s for p in folder.glob("step-*.rank*.json") if (s := _step_of(p.name)) is not None]
    return max(steps, default=0)


def start_line(ctx: WorkerContext) -> str:
    """The one line rank 0 prints at start: who decides, and what is not available here."""
    return (
        f"remedy: {ctx.world_size} ranks started by {ctx.launcher}, no remedy supervisor: rank 0 "
        f"decides for the group; {SUPERVISOR_ONLY}; a lost or hung peer ends every rank "
        "(collective timeout REMEDY_COLLECTIVE_TIMEOUT_S)"
    )
