"""Memory remediations as in-process actions.

- `enable_activation_checkpointing`: wrap blocks of the live model so their
  activations are recomputed in backward instead of stored.
- `reduce_microbatch`: split each batch into more micro-batches with gradient
  accumulation; the global batch and the loss are unchanged.
- `switch_kv_allocator`: move live KV caches (and every new one) to another
  allocator, e.g. the paged pool that does not fragment.
- `configure_cuda_allocator`: change the CUDA caching allocator's settings
  (e.g. `expandable_segments`) where the running torch allows it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from remedy.protocol.commands import Command
from remedy.rank.actions.activation_checkpointing import (
    checkpointed_modules,
    enable_activation_checkpointing,
)
from remedy.rank.actions.inprocess import applier
from remedy.rank.actions.remediation import plain
from remedy.rank.exceptions import ActionError

if TYPE_CHECKING:
    from remedy.rank.actions.inprocess import ActionTarget


@applier("enable_activation_checkpointing")
def enable_checkpointing(
    guard: ActionTarget, params: dict[str, Any], command: Command
) -> dict[str, Any]:
    model = plain(guard.model)
    before = set(checkpointed_modules(model))
    try:
        chosen = enable_activation_checkpointing(
            model,
            modules=params.get("modules"),
            pattern=params.get("pattern"),
            fraction=params.get("fraction"),
        )
    except ValueError as exc:
        raise ActionError(str(exc)) from exc
    if not chosen:
        raise ActionError("no module matched; name module classes, a pattern or a fraction")
    added = [name for name in chosen if name not in before]
    return {
        "wrapped": chosen,
        "newly_wrapped": added,
        "detail": f"checkpointing {len(chosen)} modules ({len(added)} new)",
    }


@applier("reduce_microbatch")
def reduce_microbatch(
    guard: ActionTarget, params: dict[str, Any], command: Command
) -> dict[str, Any]:
    """Multiply the number of micro-batches by `factor` (halving each one for factor 2)."""
    factor = int(params.get("factor", 2))
    if factor < 2:
        raise ActionError(f"reduce_microbatch factor must be at least 2, got {factor}")
    state = guard.remediation
    before = state.micro_batches
    after = before * factor
    limit = state.max_micro_batches
    if limit is not None and after > limit:
        if before >= limit:
            raise ActionError(
                f"micro-batches already at the batch size ({before}); cannot split further"
            )
        after = limit
    state.micro_batches = after
    return {
        "micro_batches_before": before,
        "micro_batches_after": after,
        "detail": f"micro-batches {before} -> {after} (gradient accumulation keeps the global batch)",
    }


@applier("switch_kv_allocator")
def switch_kv_allocator(
    guard: ActionTarget, params: dict[str, Any], command: Command
) -> dict[str, Any]:
    to = str(params.get("to", "paged"))
    state = guard.remediation
    before = state.kv_allocator
    migrated, deferred = 0, 0
    for cache in list(state.kv_caches):
        if cache.allocator == to or cache.length == 0:
            continue
        if not cache.at_safe_point():
            deferred += 1
            continue
        try:
            cache.switch_allocator(to)
        except (RuntimeError, ValueError) as exc:
            raise ActionError(f"cannot move a live KV cache to {to!r}: {exc}") from exc
        migrated += 1
    state.kv_allocator = to
    return {
        "allocator_before": before,
        "allocator_after": to,
        "migrated_caches": migrated,
        "deferred_caches": deferred,
        "detail": f"KV allocator {before} -> {to}; {migrated} live caches migrated",
    }


@applier("configure_cuda_allocator")
def configure_cuda_allocator(
    guard: ActionTarget, params: dict[str, Any], command: Command
) -> dict[str, Any]:
    """Apply CUDA caching-allocator settings, e.g. {expandable_segments: true}."""
    settings = {k: v for k, v in params.items() if v is not None}
    if not settings:
        raise ActionError("configure_cuda_allocator needs at least one setting")
    if guard.device.type != "cuda":
        raise ActionError(
            f"CUDA allocator settings need a CUDA device; rank {guard.rank} trains on {guard.device.type}"
        )
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        raise ActionError(f"torch {torch.__version__} cannot change allocator settings at run time")
    text = ",".join(f"{k}:{_setting(v)}" for k, v in settings.items())
    try:
        setter(text)
    except RuntimeError as exc:
        raise ActionError(f"the CUDA allocator refused {text!r}: {exc}") from exc
    torch.cuda.empty_cache()
    return {"settings": text, "detail": f"CUDA allocator settings {text}"}


def _setting(value: Any) -> str:
    return ("True" if value else "False") if isinstance(value, bool) else str(value)
