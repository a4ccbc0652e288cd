"""Sharded models (FSDP2 `fully_shard`, HSDP) under the Guard: DTensor-aware norms and shards.

A `fully_shard`-ed model's parameters, gradients and optimizer state are
DTensors: each rank holds only its local shard. Everything the Guard does
to those tensors goes through this module:

- `local` gives the shard a rank holds, for element-wise work that needs no
  peer (clipping, sampling weights, injecting faults);
- `GlobalGradNorm` is the norm of the *whole* gradient: the squares of each
  rank's local shard summed, then one all-reduce over the mesh dimensions
  the tensors are sharded on (never the replicate dimension of HSDP, whose
  peers hold the same numbers), so it is the number the unsharded model gives;
- snapshots hold `LocalShard`s, a host copy of the local shard with the
  layout needed to rebuild the DTensor: nothing is ever gathered, and
  restoring one rebuilds DTensors that `load_state_dict` copies back into
  each rank's own shard.

Plain tensors pass through unchanged, so one code path serves DDP and FSDP.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_DTENSOR: type | None = None  # DTensor's class, once something imported it


def _dtensor_class() -> type | None:
    """DTensor's class, if anything imported it: without it no tensor is one. Importing it here
    cost every process that imports remedy 0.6 s (sympy and DTensor's ops): the supervisor's
    start is the outage of a crashed one. Kept once found (it is asked per tensor, per step)."""
    global _DTENSOR
    if _DTENSOR is None:
        cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        _DTENSOR = cls if isinstance(cls, type) else None
    return _DTENSOR


def is_dtensor(t: object) -> bool:
    cls = _DTENSOR or _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: the local shard of a DTensor, else `t` itself.

    For a DTensor parameter or gradient this is a view of the storage FSDP
    updates in place, so writing to it writes to the rank's shard.
    """
    if is_dtensor(t):
        return t._local_tensor  # type: ignore[attr-defined]
    return t


def is_sharded(model: torch.nn.Module) -> bool:
    """True when any parameter of `model` is a DTensor (FSDP2, HSDP, tensor parallel)."""
    return any(is_dtensor(p) for p in model.parameters())


def local_grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient as the tensor this rank holds (for in-place scaling)."""
    return [local(p.grad) for p in params if p.grad is not None]


def _shard_key(t: torch.Tensor) -> tuple[Any, tuple[int, ...]] | None:
    """(mesh, the mesh dims `t` is sharded on); None for a plain tensor."""
    if not is_dtensor(t):
        return None
    spec: Any = t
    dims = tuple(i for i, p in enumerate(spec.placements) if p.is_shard())
    return (spec.device_mesh, dims) if dims else None


def global_square_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, the sum of squares of the whole (unsharded) tensor, as one float32 vector.

    One all-reduce per (mesh, sharded dims) group of the tensors; ranks of a
    replicate dimension are not summed (they hold the same shard). Every
    rank of the mesh must call this with the same tensors (a collective).
    """
    if not tensors:
        return torch.zeros(0)
    device = local(tensors[0]).device
    sums = torch.stack(
        [local(t).detach().float().square().sum().to(device) for t in tensors]
    )  # one vector of local partial sums
    groups: dict[tuple[int, tuple[int, ...]], tuple[Any, list[int]]] = {}
    for i, t in enumerate(tensors):
        key = _shard_key(t)
        if key is not None:
            mesh, dims = key
            groups.setdefault((id(mesh), dims), (key, []))[1].append(i)
    for (mesh, dims), idx in groups.values():
        part = sums[idx] if len(idx) < len(tensors) else sums
        for d in dims:
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=mesh.get_group(d))
        if part is not sums:
            sums[idx] = part
    return sums


class GlobalGradNorm:
    """The L2 norm of the whole gradient of a sharded model, as a device tensor (no host sync).

    The sharded counterpart of `measure.GradNorm`: one local sum of squares
    per tensor, one all-reduce per mesh group. The squares are summed in
    float32; against the unsharded model's norm on the same batch the only
    difference is the order of the additions (about 1e-6 relative).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = list(params)

    def __call__(self) -> torch.Tensor:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        return global_square_sums(grads).sum().sqrt()


def grad_norm_for(params: list[torch.nn.Parameter]) -> Callable[[], torch.Tensor] | None:
    """A `GlobalGradNorm` when any parameter is a DTensor, else None (the plain norm serves)."""
    return GlobalGradNorm(params) if any(is_dtensor(p) for p in params) else None


def first_nonfinite_param(model: torch.nn.Module) -> str | None:
    """The first parameter whose gradient holds inf or NaN on *any* rank (the same on every rank).

    One all-reduce of one flag per parameter; runs only after a non-finite norm,
    which every rank sees, so every rank calls it.
    """
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return None
    flags = torch.stack([(~torch.isfinite(local(g))).any() for _, g in named]).to(torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    hits = flags.nonzero()
    return named[int(hits[0])][0] if len(hits) else None


def module_grad_norms(model: torch.nn.Module) -> dict[str, float]:
    """Whole-gradient norm per module of a sharded model (a collective, for diagnosis)."""
    owners: list[str] = []
    grads: list[torch.Tensor] = []
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if p.grad is not None:
                owners.append(name or "<root>")
                grads.append(p.grad)
    sums = global_square_sums(grads).tolist()
    out: dict[str, float] = {}
    for owner, sq in zip(owners, sums, strict=True):
        out[owner] = out.get(owner, 0.0) + sq
    return {k: v**0.5 for k, v in out.items()}


@contextlib.contextmanager
def _gradient_sync_off(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_sync_of(
    model: torch.nn.Module,
) -> Callable[[], contextlib.AbstractContextManager[None]] | None:
    """For micro-batches of an FSDP2 model: reduce-scatter gradients on the last one only.

    FSDP2's counterpart of DDP's `no_sync`; None for a model that is neither.
    """
    if callable(getattr(model, "set_requires_gradient_sync", None)):
        return lambda: _gradient_sync_off(model)
    return None


def sharded_scaler(scaler: Any) -> Any:
    """A `ShardedGradScaler` in place of a plain `GradScaler`, carrying its state and settings.

    A plain scaler decides on the gradients this rank holds; under FSDP an
    overflow lands in one rank's shard only, that rank skips the step while
    the others take it, and the shards part ways. The sharded scaler agrees
    on overflows over the process group. None and sharded scalers pass through.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import (  # noqa: PLC0415 - sharded jobs only
        ShardedGradScaler,
    )

    if scaler is None or isinstance(scaler, ShardedGradScaler) or not scaler.is_enabled():
        return scaler
    out = ShardedGradScaler(
        scaler._device,
        init_scale=float(scaler.get_scale()),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
    )
    out.load_state_dict(scaler.state_dict())
    return out


def rebind_groups(model: torch.nn.Module) -> None:
    """After a new process-group generation: point the model's meshes and FSDP at its groups.

    `destroy_process_group` ends every group; the next `init_process_group`
    names the new default group as the old one was named, so a 1-D mesh over
    the world resolves to it again. A mesh of several dimensions (HSDP) gets
    its groups made anew, in the order `init_device_mesh` made them. FSDP
    keeps the group objects themselves, and a step that failed mid-way left
    its iteration state behind: both are reset (`reset_iteration`).
    """
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - sharded only

    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if is_dtensor(p)}  # type: ignore[attr-defined]
    for mesh in meshes.values():
        if mesh.ndim > 1:
            fresh = init_device_mesh(
                mesh.device_type, tuple(mesh.mesh.shape), mesh_dim_names=mesh.mesh_dim_names
            )
            mesh._dim_group_names = fresh._dim_group_names
    for _, group in _fsdp_param_groups(model):
        for info in (group.mesh_info, group.post_forward_mesh_info):
            if info is None:
                continue
            if hasattr(info, "shard_process_group"):
                info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
            if hasattr(info, "replicate_process_group"):
                info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)
    reset_iteration(model)


def _fsdp_param_groups(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """(FSDP state, parameter group) of every `fully_shard`-ed module of `model`."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 - sharded only

    out: list[tuple[Any, Any]] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state: Any = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)  # torch < 2.12: one group
            if groups is None:
                groups = [state._fsdp_param_group] if state._fsdp_param_group else []
            out.extend((state, g) for g in groups)
    return out


def reset_iteration(model: torch.nn.Module) -> None:
    """Forget the FSDP iteration a failed forward or backward left half done; reshard.

    A rank whose backward failed (a peer lost mid-reduce) keeps FSDP's "final
    callback queued" flag set: its next backward then never queues the
    callback that reduces the root's gradients, while a replacement (fresh
    state) does, and the two wait on each other's collectives for ever (the
    HSDP targeted restart hung there). torch's own recovery, the root's
    `reset_iter_state`, clears that and the in-flight reduce state; older
    torch has no such call and gets the flags that matter reset by hand.
    The gradients the failed backward left on the gathered (unsharded)
    parameters are dropped too: the retried step would add to them.
    """
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415 - sharded only

    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in fsdp:
        state: Any = module._get_fsdp_state()
        if state._is_root and callable(getattr(module, "reset_iter_state", None)):
            module.reset_iter_state()
        else:
            state._state_ctx.post_backward_final_callback_queued = False
            state._state_ctx.iter_forward_root = None
    for _, group in _fsdp_param_groups(model):
        for param in group.fsdp_params:
            # Gradients the failed backward accumulated on the gathered parameters: left
            # there, the next backward adds to them (reset_iter_state keeps them).
            param.unsharded_accumulated_grad = None
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
    for module in fsdp:
        module.reshard()


# ------------------------------------------------------------------ snapshots
@dataclass
class LocalShard:
    """A host copy of one rank's shard of a DTensor and the layout to rebuild it."""

    local: torch.Tensor
    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    def rebuild(self, *, copy: bool = False) -> torch.Tensor:
        """The DTensor again, its local shard on the mesh's device (a fresh copy if `copy`)."""
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - sharded only (see above)

        device = self.mesh.device_type
        t = self.local.to(device, copy=copy) if (copy or device != "cpu") else self.local
        return DTensor.from_local(
            t, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def clone_shard(t: torch.Tensor, into: object = None) -> LocalShard:
    """Host copy of a DTensor's local shard; `into`'s buffer is overwritten when it fits."""
    src = local(t).detach()
    if (
        isinstance(into, LocalShard)
        and into.local.shape == src.shape
        and into.local.dtype == src.dtype
    ):
        # A recycled snapshot's shard of the same tensor: its layout holds; only the bytes change.
        into.local.copy_(src)
        return into
    spec: Any = t
    host = src.to("cpu", copy=True)
    return LocalShard(host, spec.device_mesh, tuple(spec.placements), spec.shape, spec.stride())


def blank_shard(shard: LocalShard) -> LocalShard:
    """Zero-filled host buffers shaped like `shard`'s (see `snapshots.blank_like`)."""
    zeros = torch.zeros(shard.local.shape, dtype=shard.local.dtype)
    return LocalShard(zeros, shard.mesh, shard.placements, shard.shape, shard.stride)


def rebuild(tree: Any, *, copy: bool = False) -> Any:
    """`tree` with every `LocalShard` turned back into its DTensor (plain values kept)."""
    if isinstance(tree, LocalShard):
        return tree.rebuild(copy=copy)
    if isinstance(tree, dict):
        return {k: rebuild(v, copy=copy) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        items = [rebuild(v, copy=copy) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def shard_bytes(tree: Any) -> int:
    """Bytes of the tensors and local shards in a snapshot tree (what a mirror must carry)."""
    if isinstance(tree, LocalShard):
        return tree.local.numel() * tree.local.element_size()
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(shard_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(shard_bytes(v) for v in tree)
    return 0
