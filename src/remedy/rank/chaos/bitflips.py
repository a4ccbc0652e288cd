"""Silent data corruption for chaos tests: one bit of a parameter, a gradient or an activation.

`bitflip` flips one bit once (a transient fault: a cosmic ray, a marginal
cell); `bad_rank` does the same on every step from `at_step`, on one rank's
*process*, as a chip that computes wrong results does until it is replaced.
Its mark in the run's fired-fault record names the process it picked, so a
replacement of that rank (another process, another chip) is healthy: only a
restart of the rank cures it, never a rollback.

Where the bit goes (`target`):

- `grad`: the rank's gradient after backward and the all-reduce (its own copy,
  as a flipped bit in the chip's memory or in its optimizer's reads): only
  this rank's numbers go wrong, and its weights part from its replicas';
- `param`: a weight, after the optimizer step (`bad_rank` sets the bit, stuck
  at one, instead of flipping it back and forth);
- `activation`: the output of a module in the forward, before the all-reduce,
  so this rank's loss and local gradients are wrong and the reduce spreads
  them to every replica.

`name` picks the parameter (`param`, `grad`) or module (`activation`); by
default the first trainable parameter, or the module that owns it. `index`
is the flat element (of the rank's local shard for a sharded model), `bit`
the bit (30, a float32's top exponent bit, makes a small value huge; the low
mantissa bits 0-22 change it a little, with no NaN).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch

from remedy.rank.exceptions import ChaosConfigError
from remedy.rank.state.sharding import local

# This process: a `bad_rank` marks the process it picked by this, so its replacement is not bad.
PROCESS = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

_SIGNED = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def flip_bit(t: torch.Tensor, index: int, bit: int, *, stuck: bool = False) -> dict[str, Any]:
    """Flip (or, `stuck`, set) bit `bit` of element `index` of `t` in place.

    The index wraps around the number of elements and the bit around the
    element's width. Returns what was done, for the chaos log.
    """
    flat = local(t).detach().view(-1)
    i = index % flat.numel()
    width = flat.element_size() * 8
    b = bit % width
    cell = flat[i : i + 1].view(_SIGNED[flat.element_size()])
    mask = 1 << b if b < width - 1 else -(1 << b)  # the sign bit, as a signed integer
    before = float(flat[i])
    value = torch.tensor([mask], dtype=cell.dtype, device=cell.device)
    if stuck:
        cell.bitwise_or_(value)
    else:
        cell.bitwise_xor_(value)
    return {"index": i, "bit": b, "before": before, "after": float(flat[i])}


def find_parameter(model: torch.nn.Module, name: str | None) -> tuple[str, torch.nn.Parameter]:
    """The parameter `name` of `model` (a DDP wrapper's `module.` prefix may be left out);
    the first trainable one without a name."""
    named = [(n.removeprefix("module."), p) for n, p in model.named_parameters()]
    if name is None:
        found = next(((n, p) for n, p in named if p.requires_grad), None)
    else:
        found = next(((n, p) for n, p in named if n == name.removeprefix("module.")), None)
    if found is None:
        known = ", ".join(n for n, _ in named[:12])
        raise ChaosConfigError(
            f"chaos: the model has no parameter {name!r} to corrupt; its parameters: {known}"
        )
    return found


def find_module(model: torch.nn.Module, name: str | None) -> tuple[str, torch.nn.Module]:
    """The module `name` of `model`; without a name, the one that owns the first trainable
    parameter."""
    named = {n.removeprefix("module."): m for n, m in model.named_modules()}
    if name is None:
        pname, _ = find_parameter(model, None)
        name = pname.rpartition(".")[0]
    module = named.get(name.removeprefix("module."))
    if module is None:
        known = ", ".join(n for n in list(named)[:12] if n)
        raise ChaosConfigError(
            f"chaos: the model has no module {name!r} whose output to corrupt; its modules: {known}"
        )
    return name, module


def corrupt_output(output: Any, index: int, bit: int) -> tuple[Any, dict[str, Any]]:
    """A forward output with one bit of its first floating tensor flipped (a changed copy:
    the module's own tensors are left alone, autograd flows through the copy)."""
    if isinstance(output, torch.Tensor):
        changed = output.clone()
        return changed, flip_bit(changed, index, bit)
    if isinstance(output, tuple | list):
        items = list(output)
        for i, item in enumerate(items):
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                items[i], done = corrupt_output(item, index, bit)
                return type(output)(items), done
    return output, {}
