"""A DDP model on a new process-group generation: its reducer rebuilt, its buckets laid out alike.

A survivor re-initialises DDP on the group it has just formed
(`rebuild_ddp`); every rank then takes the source rank's bucket layout
(`ddp_bucket_layout`, `relayout_ddp`), so the new group sums gradients in
the same order as a run that never lost a rank (`rank.group.regroup`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from remedy.rank.guard import Guard


def rebuild_ddp(guard: Guard) -> None:
    """Re-initialise a DDP model on the current default group, keeping its settings.

    The optimizer holds the module's parameters, which stay the same tensors;
    only DDP's reducer and its hooks are rebuilt. Detectors that timed the old
    reducer's all-reduces attach to the new one.
    """
    model = guard.model
    ddp = torch.nn.parallel.DistributedDataParallel
    if not isinstance(model, ddp):
        return
    ddp.__init__(
        model,
        model.module,
        device_ids=model.device_ids,
        output_device=model.output_device,
        dim=model.dim,
        # Not the deprecated broadcast_buffers (a FutureWarning in the user's output at every
        # replacement). Unlike it, this syncs buffers at init even when False: harmless here,
        # where every rank of the new group adopts one rank's state anyway.
        forward_sync_buffers=model.forward_sync_buffers,
        bucket_cap_mb=model.bucket_bytes_cap / (1024 * 1024),
        find_unused_parameters=model.find_unused_parameters,
        gradient_as_bucket_view=model.gradient_as_bucket_view,
        static_graph=model.static_graph,
    )
    _reattach_timers(guard)


def ddp_bucket_layout(model: Any) -> list[list[int]] | None:
    """A DDP model's gradient buckets as parameter indices, in the reducer's order."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    params, _ = model._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(params)}
    buckets = model.reducer._get_zeros_like_grad_buckets()
    return [[index[id(p)] for p in bucket.parameters()] for bucket in buckets]


def relayout_ddp(guard: Guard, layout: list[list[int]] | None) -> None:
    """Give a DDP model a fresh reducer whose buckets are `layout` (no collectives).

    A new DDP starts with buckets in reverse parameter order and rebuilds them
    after its first step from the order gradients arrived in. A long-running
    rank has rebuilt them already; gloo and NCCL sum each element in an order
    that depends on where it sits in its bucket, so a replacement (and the
    survivors, whose DDP was re-initialised) take the source's layout to give
    the same bits as a run that never lost a rank.
    """
    model = guard.model
    if layout is None or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    params, sparse = model._build_params_for_reducer()
    limit = model.bucket_bytes_cap
    original = dist._compute_bucket_assignment_by_size

    def fixed(*_args: Any, **_kwargs: Any) -> tuple[list[list[int]], list[int]]:
        # DDP reverses what this returns before building its reducer.
        return list(reversed(layout)), [limit] * len(layout)

    dist._compute_bucket_assignment_by_size = fixed
    try:
        model._ddp_init_helper(
            params, sparse, model._build_debug_param_to_name_mapping(params), model.static_graph
        )
    finally:
        dist._compute_bucket_assignment_by_size = original
    _reattach_timers(guard)


def _reattach_timers(guard: Guard) -> None:
    """Detectors that timed the old reducer's all-reduces attach to the new one."""
    for detector in guard.detectors.detectors:
        d: Any = detector
        if getattr(d, "timer", None) is not None and callable(getattr(d, "attach", None)):
            d.timer = None
            d.attach(guard.model)
