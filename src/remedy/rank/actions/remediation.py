"""The remediations in force on a rank: what actions changed about how it trains.

- `lr_cut`: `shrink_lr`'s cuts (`lr_scale.LRScale`), applied around each
  optimizer step whatever the schedule does;
- `micro_batches`: `reduce_microbatch`'s split of each batch, bounded by
  `max_micro_batches` (the batch size, once a batch was seen);
- the activation-checkpointed modules: `enable_activation_checkpointing`
  wraps them in the model itself, so they are read back from it by name;
- `kv_allocator`: `switch_kv_allocator`'s choice for new KV caches, with the
  live caches (`kv_caches`) it moves.

The Guard and the framework callbacks each own one `Remediation`, the
appliers change it (`actions.ActionTarget.remediation`), and both a
replacement rank adopting a survivor's state (`train_state`) and a rank
resuming from a checkpoint (`restore_point`) carry it through `state` and
`adopt`, so a remediation decided once stays in force exactly once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from remedy.rank.actions.activation_checkpointing import (
    checkpointed_modules,
    enable_activation_checkpointing,
)
from remedy.rank.actions.lr_scale import LRScale

# The keys `Remediation.state` gives (and a checkpoint's `extra` holds).
KEYS = ("micro_batches", "kv_allocator", "lr_cut", "checkpointed")


def plain(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a DDP or FSDP-style wrapper (`.module`), whose submodule names
    activation checkpointing uses, or `model` itself."""
    inner = getattr(model, "module", model)
    return inner if isinstance(inner, torch.nn.Module) else model


@dataclass(slots=True, eq=False)
class Remediation:
    """See the module docstring."""

    micro_batches: int = 1
    kv_allocator: str = "fixed"
    lr_cut: LRScale = field(default_factory=LRScale)
    max_micro_batches: int | None = None
    kv_caches: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)

    @property
    def lr_scale(self) -> float:
        return self.lr_cut.scale

    def state(self, model: torch.nn.Module) -> dict[str, Any]:
        """What is in force, as plain values (`KEYS`) for a checkpoint or another rank."""
        return {
            "micro_batches": self.micro_batches,
            "kv_allocator": self.kv_allocator,
            "lr_cut": (self.lr_cut.scale, self.lr_cut.floor),
            "checkpointed": checkpointed_modules(plain(model)),
        }

    def adopt(self, state: dict[str, Any], model: torch.nn.Module) -> None:
        """Put in force what `state` (another rank's or a checkpoint's `state()`) says.

        Activation checkpointing is added to the modules named there; one
        already wrapped stays wrapped (a module is never wrapped twice).
        """
        scale, floor = state["lr_cut"]
        self.lr_cut = LRScale(scale=scale, floor=floor)
        self.micro_batches = int(state["micro_batches"])
        self.kv_allocator = str(state["kv_allocator"])
        if state["checkpointed"]:
            enable_activation_checkpointing(plain(model), modules=list(state["checkpointed"]))
