"""The one regroup of a rank: its process group re-formed as a new generation, in a fixed order.

A rank enters a new generation two ways, and both go through `regroup`, the
only entry (the Guard calls it from one place, `Guard._rejoined`):

- a **survivor**, when a collective failed because a peer was lost: it keeps
  its process and its state, leaves the broken group and forms the next
  generation that the supervisor orders (`Membership.order`);
- a **replacement**, at its first step boundary: it started in the new
  generation (`Membership.join`) and adopts the group's state there.

The order, the same on every rank of the generation (steps marked *c* are
collectives, which every rank must run in the same order):

1. survivor: note the error (`timeline`, phase `recovering`); break off the
   broken group's gloo connections, so peers blocked on this rank are freed;
   report at once (`collective_failed`: the supervisor looks for the lost peer
   now, not after the hang watch's timeout);
2. survivor: wait for the supervisor's order (generation, source rank, store);
3. survivor: discard the failed step (a collective failed inside it): back to
   the boundary it started from (data position, a batch given back, RNG,
   gradients);
4. survivor: wait for the shard mirror's exchange, leave the broken group;
5. survivor, the source of an unsharded job: capture its own state before DDP's
   re-initialisation overwrites it with rank 0's;
6. survivor: rendezvous (*c*, phase `joining`); a rendezvous that fails, or a
   peer lost while the generation forms (a replacement dying in step 8), ends
   this generation: leave it and wait for the next order (back to 5);
7. survivor: the Guard agrees through the new group (`Guard.use_group`: the
   command agreement, the phase exchange, the flag hold's quiet period); a
   sharded job makes its new groups (*c*) in the order a replacement's start
   makes them: the shards' meshes and FSDP (`sharding.rebind_groups`), the
   DCP store's write group, the shard mirror's group; its gloo connections
   are tracked again;
8. every rank adopts the generation's state (*c*): a sharded rank keeps or
   restores its shard (`shard_mirror.restore_group`: a replica's, the buddy's
   mirror, or DCP); an unsharded survivor rebuilds DDP on the new group, and
   every rank takes the source's broadcast state and its DDP bucket layout;
9. the next report goes out at once and says `regrouped` (`Outbox.regrouped`);
10. the membership's record: recoveries, the timeline, phase `boundary`.

Under another launcher (`launched.LaunchedGroup`) no rank can be replaced: a
lost peer ends the rank (`GroupLostError`) instead.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import structlog
import torch.distributed as dist

from remedy.protocol import phases
from remedy.rank.exceptions import GroupLostError
from remedy.rank.group.ddp_layout import ddp_bucket_layout, rebuild_ddp, relayout_ddp
from remedy.rank.group.membership import Membership, is_group_failure
from remedy.rank.state import shard_mirror, sharding, train_state
from remedy.rank.state.snapshots import restore_rng

if TYPE_CHECKING:
    from remedy.rank.guard import Guard

log = structlog.get_logger("remedy.membership")


def regroup(guard: Guard, failed: BaseException | None = None, *, in_step: bool = False) -> bool:
    """Bring this rank into its group's new generation, if it has one to enter.

    `failed`: the error a collective just raised (None: a step boundary, where a
    replacement adopts the group's state). `in_step`: it failed inside a step,
    which is discarded. True once this rank is in the new generation; False when
    there is nothing to enter: not a replacement's first boundary, or `failed` is
    not a lost peer (the caller raises it). Raises `GroupLostError` when no order
    to regroup comes in time, or, under another launcher, for any lost peer.
    """
    membership = guard.membership
    if not isinstance(membership, Membership):  # none, or another launcher's group
        if failed is None or membership is None:
            return False
        return bool(membership.recover(guard, failed, in_step=in_step))
    if failed is None:
        return _join(guard, membership)
    return _survive(guard, membership, failed, in_step=in_step)


def _join(guard: Guard, membership: Membership) -> bool:
    """A replacement's first boundary: adopt the source rank's state with every peer (8-10)."""
    if membership.adopt_from is None:
        return False
    source, membership.adopt_from = membership.adopt_from, None
    t0 = time.perf_counter()
    membership.timeline["adopting"] = time.time()
    guard.injector.on_join()  # chaos: a kill_rank that kills replacements too
    # No peer holds a sharded rank's shard whole: it comes from its buddy (shard_mirror).
    if guard.sharded:
        membership.last_restore = shard_mirror.restore_group(guard, fresh=True)
    else:
        state = train_state.broadcast(guard, src=source, joining=True)
        relayout_ddp(guard, state.get("ddp_buckets"))
    membership.timeline["adopted"] = time.time()
    guard.outbox.regrouped()  # report the first step of the new generation at once
    membership.at_boundary(guard)
    log.info("state_adopted", rank=membership.rank, source=source, step=guard.step_count,
             seconds=round(time.perf_counter() - t0, 4))  # fmt: skip
    return True


def _survive(guard: Guard, membership: Membership, exc: BaseException, *, in_step: bool) -> bool:
    """After a failed collective: re-form the group without the lost peer (1-10)."""
    if membership.world_size <= 1 or not is_group_failure(exc):
        return False
    t0 = time.perf_counter()
    membership.timeline = {"error": time.time()}
    membership.phase = phases.RECOVERING
    # gloo: peers still blocked on this rank (not on the lost one) stay blocked
    # while this process holds the broken group's connections; break them off
    # now, before waiting for the order, so only the lost rank is replaced.
    released = membership.release_sockets()
    membership.timeline["released"] = time.time()
    log.warning(
        "collective_failed",
        rank=membership.rank,
        step=guard.step_count,
        error=str(exc)[:200],
        released=released,
    )
    # The steps run since the last report reach the supervisor now: this process
    # may be killed while it waits (a full-group restart), and they were executed.
    # The report says the collective failed: the supervisor looks for the lost peer
    # at once, where its silence would take the hang watch's timeout to show.
    guard.send_report(collective_failed=True)
    generation, source, store_addr = membership.next_order()
    membership.timeline["order"] = time.time()
    if in_step:
        _discard_step(guard, membership)
    if guard.mirror is not None:
        # Its exchange fails (its sockets are released) before its group.
        guard.mirror.wait()
    membership.leave()
    membership.timeline["left"] = time.time()
    captured = None
    formed = membership.generation  # the last generation this process was part of
    overwritten = False  # its live state may hold a failed generation's start-up sync
    while True:
        if membership.rank == source and captured is None and not guard.sharded:
            if overwritten:
                raise GroupLostError(
                    f"rank {membership.rank}: ordered to be the source of generation "
                    f"{generation}, but its state may hold the start-up sync of a generation "
                    "that failed while it formed"
                )
            # Taken before DDP's re-initialisation, whose start-up sync copies rank 0's
            # parameters, and rank 0 may be a fresh replacement.
            captured = {
                **train_state.capture(guard),
                "ddp_buckets": ddp_bucket_layout(guard.model),
            }
        elif membership.rank != source:
            captured = None
        membership.generation = generation
        membership.use_store(store_addr)
        # Said in pings: a rendezvous can wait forever for a peer that died in it (see
        # phases.JOINING), and only the supervisor can end that wait, by replacing this rank.
        membership.phase = phases.JOINING
        try:
            membership.join()  # rendezvous: STORE_CONNECT_S to connect, collective_timeout() to form
        except (RuntimeError, dist.DistError) as failed:
            # The rendezvous itself failed: the supervisor closed its store (its next
            # attempt forms the next generation over a new one), or the supervisor
            # serving it died (the one Ray restarts orders the group again, with its store).
            log.warning("rendezvous_failed", rank=membership.rank, generation=generation,
                        error=str(failed)[:200])  # fmt: skip
            membership.leave()
            _forget_failed_group()
            if isinstance(failed, dist.DistNetworkError):
                membership.forget_store()  # its server is gone: connect again for the next order
            membership.generation = formed  # not part of `generation`: any order past it counts
            generation, source, store_addr = membership.next_order()
            continue
        joined = time.perf_counter()
        membership.phase = phases.RECOVERING  # formed: adopting the source's state
        try:
            new_groups(guard)
            if guard.sharded:  # its mesh's groups and the mirror's: released with the world's
                membership.track_more_sockets()
            _adopt(guard, membership, source, captured)
            break
        except Exception as failed:
            if not is_group_failure(failed):
                raise
            # A peer was lost while the generation formed (a replacement that died as
            # it adopted the state): this generation is over, and the supervisor's next
            # attempt orders the next one. Peers still blocked on this rank are freed.
            released = membership.release_sockets()
            log.warning("regroup_failed", rank=membership.rank, generation=generation,
                        error=str(failed)[:200], released=released)  # fmt: skip
            membership.leave()
            formed = generation
            overwritten = overwritten or membership.rank != source
            generation, source, store_addr = membership.next_order()
    membership.timeline["adopted"] = time.time()
    guard.outbox.regrouped()  # report the first step of the new generation at once
    membership.recoveries += 1
    membership.last_recovery = {
        "generation": generation,
        "source": source,
        "rendezvous_s": round(joined - t0, 4),
        "total_s": round(time.perf_counter() - t0, 4),
    }
    membership.at_boundary(guard)
    log.warning("regrouped", rank=membership.rank, **membership.last_recovery)
    return True


def _discard_step(guard: Guard, membership: Membership) -> None:
    """The failed step is discarded: back to the boundary it started from (3)."""
    mark = membership.step_start
    if mark is None:
        return
    position, rng = mark
    guard.cursor.position = position
    step_mark = guard.step_mark
    if not guard.cursor.rewindable and step_mark is not None and step_mark.batch_index >= 0:
        # A plain iterable cannot read the step's batch again: it is given back, so
        # this rank trains it next, as a replacement that catches up to this position
        # does (the rank would otherwise run one batch ahead of its peers, and out of
        # data a step before them).
        guard.cursor.unread([(step_mark.batch_index, step_mark.batch)])
    restore_rng(rng)
    guard.optimizer.zero_grad(set_to_none=True)


def new_groups(guard: Guard) -> None:
    """In the generation just formed: the Guard's agreement and a sharded job's groups (7).

    New groups are collectives: every survivor makes them in the order a
    replacement's start makes them (its mesh, then `Guard`'s checkpoint store and
    shard mirror)."""
    guard.use_group(dist.group.WORLD)
    if not guard.sharded:
        return
    sharding.rebind_groups(guard.model)
    renew = getattr(guard.checkpoints, "renew_group", None)  # a DCP store's write group
    if callable(renew):
        renew()
    if guard.mirror is not None:
        guard.mirror.renew_group()


def _adopt(
    guard: Guard, membership: Membership, source: int, captured: dict[str, Any] | None
) -> None:
    """A survivor adopts the generation's state (8): a sharded rank keeps its shard, the others
    rebuild DDP and take rank `source`'s state (`captured`: the source's own, taken before)."""
    if guard.sharded:  # each survivor keeps its own shard (shard_mirror)
        membership.last_restore = shard_mirror.restore_group(guard, fresh=False)
        return
    rebuild_ddp(guard)
    membership.timeline["ddp"] = time.time()
    state = train_state.broadcast(guard, src=source, state=captured)
    relayout_ddp(guard, state.get("ddp_buckets"))


def _forget_failed_group() -> None:
    """After an `init_process_group` that failed, name the next group as a fresh process would.

    torch names the default group from a counter (`_world.group_count`) that
    the failed call advanced and that only `destroy_process_group` resets; the
    rendezvous keys carry the name, so a survivor whose rendezvous failed once
    waited under "1/" while a fresh replacement waited under "0/", forever.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0
