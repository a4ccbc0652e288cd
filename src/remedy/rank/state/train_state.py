"""Training state as one value: capture it, adopt it, broadcast it to a new process group.

After a rank is replaced, every rank of the next generation adopts the
state of the lowest healthy rank, so the replacement (a fresh process) and
the survivors continue from one identical boundary. The state is
everything a step depends on: model, optimizer, LR scheduler, GradScaler,
every RNG, the data position and the skipped batches, the detectors'
histories (so the replacement judges its first steps as the source
would), every remediation applied so far (LR scale, micro-batch split,
activation-checkpointed modules, KV allocator) and the command bookkeeping
(applied, queued and failed commands), so a command in flight is applied at
the same boundary by the replacement too.

The user's registered objects (`user_state`) travel in the snapshot. A rank
adopting a peer's state loads only the replicated ones; per-rank objects and
the data source's own state stay the rank's: a survivor's are already at the
boundary, a replacement (`joining`) takes its per-rank objects from the
newest durable checkpoint its rank wrote at or before the adopted step, and
its fresh data source reads up to the adopted position (`BatchCursor`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch.distributed as dist

if TYPE_CHECKING:
    from remedy.rank.guard import Guard

log = structlog.get_logger("remedy.train_state")


def capture(guard: Guard) -> dict[str, Any]:
    """Host copy of `guard`'s training state at the current step boundary."""
    snap = guard.take_snapshot()
    return {
        "snapshot": snap,
        "skipped": sorted(guard.cursor.skipped),
        **guard.remediation.state(guard.model),
        **guard.inbox.state(),
    }


def adopt(guard: Guard, state: dict[str, Any], *, own: bool = False, joining: bool = False) -> None:
    """Make `guard` continue from `state` exactly (no remediation is applied twice).

    `own`: the state is this rank's (a resume, its own capture), so its per-rank user
    state and data source state are loaded too. `joining`: this process is a
    replacement adopting a peer's state (see the module docstring).
    """
    snap = state["snapshot"]
    # What a rollback restores: weights, optimizer, scheduler, scaler, RNG, step, and the
    # detectors' histories (a replacement judges its first step as the source would).
    guard.restore(snap, own=own)
    if joining and not own:
        _own_per_rank(guard, snap.step)
    guard.tick = snap.tick
    guard.cursor.position = snap.cursor  # also for a source that cannot seek: ranks must agree
    guard.cursor.skipped = set(state["skipped"])
    # The param groups hold the scheduled LR; the cuts decided so far are applied around
    # each optimizer step (lr_scale.py), so a replacement must adopt them to step alike.
    guard.remediation.adopt(state, guard.model)
    guard.inbox.adopt(state)
    # Rings differ between survivors and the replacement; all restart from this boundary.
    guard.saver.start_over(snap)


def broadcast(
    guard: Guard,
    *,
    src: int,
    group: Any = None,
    state: dict[str, Any] | None = None,
    joining: bool = False,
) -> dict[str, Any]:
    """Every rank of the group calls this; all adopt rank `src`'s state, which is returned.

    The source sends `state` if given (captured before something overwrote
    its live state, such as DDP's start-up sync from a replaced rank 0; it
    then adopts it too), else what `capture` takes now. `joining`: this rank is
    a replacement (its per-rank user state comes from its rank's checkpoint).

    One pickled object broadcast: on CPU tensors the cost is a copy of the
    state per rank (a few ms for the example's 0.8M parameters).
    """
    source = dist.get_rank() == src
    payload: list[Any] = [(state or capture(guard)) if source else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    adopted: dict[str, Any] = payload[0]
    if not source or state is not None:
        adopt(guard, adopted, own=source, joining=joining)
    else:
        # The source too drops its ring, so every rank keeps the same snapshots.
        guard.saver.start_over(adopted["snapshot"])
    return adopted


def _own_per_rank(guard: Guard, step: int) -> None:
    """A replacement's per-rank user state: its rank's copy in the newest good durable checkpoint
    at or before `step`, the only one that outlived the lost process; else as constructed."""
    names = guard.user_state.names(per_rank=True)
    store = guard.checkpoints
    # A sharded rank's own state comes from its buddy's mirror instead (shard_mirror).
    if not names or store is None or guard.sharded:
        return
    good = store.verified_steps(at_or_before=step)
    if not good:
        log.info("per_rank_state_as_constructed", rank=guard.rank, names=names, step=step)
        return
    saved = store.load(good[-1])
    loaded = guard.user_state.load(saved.user, names=names)
    log.info("per_rank_state_from_checkpoint", rank=guard.rank, names=loaded,
             checkpoint_step=saved.step, step=step)  # fmt: skip
