"""Turning activation checkpointing on and off in a live model, and measuring what it saves.

`enable_activation_checkpointing` is the applier of the
`enable_activation_checkpointing` action: it wraps chosen submodules so their
forward runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`,
in place, at a safe point between steps. Parameters stay the same objects and
the state_dict keys do not change, so the optimizer, its state and every
checkpoint remain valid. `disable_activation_checkpointing` undoes it.

`SavedActivationMeter` counts the bytes autograd saves for backward during a
forward; `SavedActivationCap` turns a limit on them into a real
`torch.OutOfMemoryError`, so OOM recovery can be exercised on CPU.
"""

from __future__ import annotations

import fnmatch
import math
import weakref
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

__all__ = [
    "SavedActivationCap",
    "SavedActivationMeter",
    "checkpointed_modules",
    "disable_activation_checkpointing",
    "enable_activation_checkpointing",
]


class _CheckpointedForward:
    """Stands in for a module's `forward` on the instance; runs the real one under checkpoint.

    Holds the module and, if the instance had its own `forward` attribute
    before, that one; otherwise the class's forward is looked up at call time,
    so nothing stale is kept and the module still pickles and deep-copies.
    """

    def __init__(self, module: nn.Module, previous: Any | None) -> None:
        self.module = module
        self.previous = previous

    def inner(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Without grad nothing is saved, and recomputing would replay side effects
        # such as a KV cache's update during generation: run plainly.
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _is_wrapped(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def _default_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """What to checkpoint when the action names nothing, for any model.

    Transformer-style models first: modules of class `Block`, else the
    children of the longest uniform ModuleList (the repeated layers). Other
    models (an MLP, a conv net, a recurrent net) have no repeated unit, so
    the stages of the model are taken instead (`_stages`).
    """
    blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "Block"]
    if blocks:
        return blocks
    best: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len({type(c) for c in mod}) == 1:
            kids = [(f"{name}.{k}" if name else k, c) for k, c in mod.named_children()]
            if len(kids) > len(best):
                best = kids
    return best or _stages(model)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _stages(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's containers with parameters (`features`, `encoder`), else the whole model.

    Checkpointing a single leaf layer saves nothing (its input is kept to
    recompute it, and that input is what the layer saved anyway); a container
    keeps only its input and recomputes everything inside. Wrappers with a
    single child (`model.net = nn.Sequential(...)`) are looked through. A
    model made only of leaf layers (a plain `nn.Sequential` MLP) is wrapped
    whole: its forward keeps only the batch and is recomputed in backward.
    """
    prefix, root = "", model
    while True:
        kids = [(n, c) for n, c in root.named_children() if _has_params(c)]
        if len(kids) != 1 or not any(True for _ in kids[0][1].children()):
            break
        name, root = kids[0]
        prefix = f"{prefix}{name}."
    stages = [
        (f"{prefix}{n}", c)
        for n, c in root.named_children()
        if _has_params(c) and any(True for _ in c.children())
    ]
    if stages:
        return stages
    return [(prefix.rstrip("."), root)] if _has_params(root) else []


def _inside(name: str, ancestor: str) -> bool:
    """True if module `name` is strictly inside module `ancestor` ("" is the root)."""
    return name != ancestor and (ancestor == "" or name.startswith(f"{ancestor}."))


def _select(
    model: nn.Module,
    modules: list[str] | None,
    pattern: str | None,
    fraction: float | None,
) -> list[tuple[str, nn.Module]]:
    if modules is None and pattern is None:
        found = _default_candidates(model)
    else:
        wanted = set(modules or ())
        found = [
            (name, mod)
            for name, mod in model.named_modules()
            if (modules is None or type(mod).__name__ in wanted or name in wanted)
            and (pattern is None or fnmatch.fnmatchcase(name, pattern))
        ]
    # Checkpointing a module inside a checkpointed one only recomputes twice: keep the outermost.
    outer: list[tuple[str, nn.Module]] = []
    for name, mod in found:
        if not any(_inside(name, o) for o, _ in outer):
            outer.append((name, mod))
    wrapped = checkpointed_modules(model)
    outer = [(n, m) for n, m in outer if not any(_inside(n, w) for w in wrapped)]
    if fraction is not None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        outer = outer[: math.ceil(fraction * len(outer))]
    return outer


def enable_activation_checkpointing(
    model: nn.Module,
    *,
    modules: list[str] | None = None,
    pattern: str | None = None,
    fraction: float | None = None,
) -> list[str]:
    """Checkpoint the chosen submodules in place; return their qualified names.

    `modules` selects by class name (or qualified name), `pattern` by an
    fnmatch pattern on qualified names (both apply when both are given), and
    `fraction` keeps the first share of the selection (rounded up). The
    default is every `Block`, or else the repeated children of a ModuleList.
    Calling again is harmless: modules already wrapped stay wrapped once.
    """
    chosen = _select(model, modules, pattern, fraction)
    for _, mod in chosen:
        if not _is_wrapped(mod):
            # An instance attribute shadows the class's forward; parameters are untouched.
            mod.__dict__["forward"] = _CheckpointedForward(mod, mod.__dict__.get("forward"))
    return [name for name, _ in chosen]


def disable_activation_checkpointing(model: nn.Module) -> list[str]:
    """Restore every wrapped submodule's own forward; return their qualified names."""
    restored = []
    for name, mod in model.named_modules():
        wrapper = mod.__dict__.get("forward")
        if isinstance(wrapper, _CheckpointedForward):
            if wrapper.previous is None:
                del mod.__dict__["forward"]
            else:
                mod.__dict__["forward"] = wrapper.previous
            restored.append(name)
    return restored


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Qualified names of the submodules currently running under activation checkpointing."""
    return [name for name, mod in model.named_modules() if _is_wrapped(mod)]


class _Packed:
    """What autograd keeps instead of the tensor; its death tells the meter the bytes are gone."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivationMeter:
    """Counts the bytes of activations saved for backward while the context is open.

    Each storage counts once however many views of it are saved. Parameters
    (leaf tensors that require grad, and views of them) are not activations and
    are skipped unless `count_parameters`. `bytes` is everything saved inside
    the context; `live` is what is still held by a graph; `peak` is the most
    `live` has been; `tensors` counts the saved tensors, views included.
    """

    def __init__(self, *, count_parameters: bool = False) -> None:
        self.count_parameters = count_parameters
        self.bytes = 0
        self.live = 0
        self.peak = 0
        self.tensors = 0
        self._refs: dict[tuple[str, int], int] = {}
        self._sizes: dict[tuple[str, int], int] = {}
        self._hooks = saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> SavedActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)

    def _admit(self, key: tuple[str, int], nbytes: int) -> None:
        """Hook for subclasses: called before a new storage is counted."""

    def _pack(self, tensor: torch.Tensor) -> Any:
        root = tensor._base if tensor._base is not None else tensor
        if not self.count_parameters and root.is_leaf and root.requires_grad:
            return tensor
        key, nbytes = _storage_key(tensor)
        self.tensors += 1
        if self._refs.get(key, 0) == 0:
            self._admit(key, nbytes)
            self._sizes[key] = nbytes
            self.bytes += nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        packed = _Packed(tensor)
        weakref.finalize(packed, self._forget, key)
        return packed

    def _forget(self, key: tuple[str, int]) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Packed) else packed


def _storage_key(tensor: torch.Tensor) -> tuple[tuple[str, int], int]:
    """(device, storage address) and the storage's size; tensors without one count alone."""
    try:
        storage = tensor.untyped_storage()
        if storage.data_ptr() != 0:
            return (str(tensor.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        pass
    return ("tensor", id(tensor)), tensor.nelement() * tensor.element_size()


class SavedActivationCap(SavedActivationMeter):
    """A meter that raises `torch.OutOfMemoryError` once live saved bytes would exceed a cap."""

    def __init__(self, limit_bytes: int, *, count_parameters: bool = False) -> None:
        super().__init__(count_parameters=count_parameters)
        self.limit_bytes = limit_bytes

    def _admit(self, key: tuple[str, int], nbytes: int) -> None:
        if self.live + nbytes > self.limit_bytes:
            raise torch.OutOfMemoryError(
                f"Saved activations out of memory: tried to save {self.live + nbytes} bytes "
                f"of activations with a cap of {self.limit_bytes} bytes ({nbytes} bytes in "
                f"this tensor, {self.live} already saved). Enable activation checkpointing "
                "or reduce the micro-batch."
            )
