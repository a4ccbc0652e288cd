"""The one sentence every decision carries.

A reason says what was seen, which rule matched (and on what condition),
and why this action: ``nonfinite_loss on rank 0 at step 150 matched rule
'nan-rollback' (1 within 1 step); rolling back 50 steps and skipping 20
batches, fire 1 of 3 within 1000 steps.`` Suppressed and escalated
decisions say why nothing (or something else) was done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from remedy.policies._events import AnomalyEvent
from remedy.policies._rules import Rule, Step


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0-3, 7``: consecutive ranks collapse into ranges."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ", ".join(parts)


def seen(event: AnomalyEvent, ranks: Sequence[int]) -> str:
    """What was observed: ``loss_spike (value 12.5, threshold 4) on ranks 0-7 at step 150``."""
    measured = ""
    if event.value is not None:
        measured = f"value {event.value:.4g}"
        if event.threshold is not None:
            measured += f", threshold {event.threshold:.4g}"
        measured = f" ({measured})"
    checkpoint = event.details.get("checkpoint_step") if event.details else None
    if event.kind == "checkpoint_corrupt" and type(checkpoint) is int:
        # Which checkpoint failed: the step of the event is only when the restore ran.
        measured = f" (the checkpoint of step {checkpoint} failed its checksum)"
    if event.kind == "checkpoint_write_failed" and type(checkpoint) is int:
        measured = f" (the checkpoint of step {checkpoint} could not be written)"
    return f"{event.kind}{measured} on {ranks_text(ranks)} at step {event.step}"


def condition(rule: Rule) -> str:
    """The rule's firing condition: ``(3 within 100 steps)`` or ``(held for 5 steps)``."""
    window = rule.within.describe() if rule.within is not None else "1 step"
    text = f"{rule.count} within {window}"
    if rule.persist > 1:
        text += f", held for {rule.persist} steps"
    return f"({text})"


def fires_text(rule: Rule, fire_number: int) -> str:
    """``, fire 1 of 3 within 1000 steps`` (empty when the rule has no max_fires)."""
    if rule.max_fires is None:
        return ""
    return f", fire {fire_number} of {rule.max_fires} {fires_window(rule)}"


def fires_window(rule: Rule) -> str:
    """``within 1000 steps`` or ``in this run``."""
    if rule.fires_within is None:
        return "in this run"
    return f"within {rule.fires_within.describe()}"


def chain_text(rule: Rule, index: int, steps: Sequence[Step]) -> str:
    """``rolling back 50 steps`` or ``step 2 of 3: shrinking the learning rate x0.5``."""
    phrase = action_phrase(steps[index].action, steps[index].params)
    if len(steps) == 1:
        return phrase
    return f"step {index + 1} of {len(steps)}: {phrase}"


def action_phrase(action: str, params: Mapping[str, Any]) -> str:
    """What an action does, in words, with its parameters."""
    p = params
    if action == "rollback":
        text = f"rolling back {p.get('steps_back')} steps"
        if p.get("source") == "disk":
            older = p.get("older") or 0
            text += " to an older durable checkpoint" if older else " to a durable checkpoint"
        skip = p.get("skip_batches") or 0
        return text + (f" and skipping {skip} batches" if skip else "")
    if action == "shrink_lr":
        floor = p.get("min_lr") or 0
        return f"shrinking the learning rate x{p.get('factor'):g}" + (
            f" (floor {floor:g})" if floor else ""
        )
    if action == "rescale_grad_scaler":
        if p.get("scale") is not None:
            return f"setting the loss scale to {p['scale']:g}"
        if p.get("factor") is not None:
            return f"multiplying the loss scale by {p['factor']:g}"
        return "resetting the loss scale"
    if action == "enable_activation_checkpointing":
        return "enabling activation checkpointing"
    if action == "switch_kv_allocator":
        return f"switching the KV cache allocator to {p.get('to')}"
    if action == "restart_rank":
        return "restarting the affected ranks"
    if action == "skip_batches":
        return f"skipping {p.get('count')} batches"
    if action == "reduce_microbatch":
        return f"dividing the micro-batch size by {p.get('factor')}"
    if action == "checkpoint_now":
        return "writing a checkpoint now"
    if action == "dump_diagnostics":
        return "dumping diagnostics"
    if action == "notify":
        return "notifying"
    if action == "configure_cuda_allocator":
        return "configuring the CUDA caching allocator" + _allocator_settings(p)
    if action == "abort":
        return "aborting the run"
    # An action this table does not know yet: say which, never what another action does.
    return f"carrying out {action}"


def _allocator_settings(params: Mapping[str, Any]) -> str:
    """`` (expandable segments on, max split 128 MB)`` for the settings that are given."""
    parts = []
    expandable = params.get("expandable_segments")
    if expandable is not None:
        parts.append(f"expandable segments {'on' if expandable else 'off'}")
    threshold = params.get("garbage_collection_threshold")
    if threshold is not None:
        parts.append(f"garbage collection at {threshold:g} of the cache")
    split = params.get("max_split_size_mb")
    if split is not None:
        parts.append(f"max split {split} MB")
    return f" ({', '.join(parts)})" if parts else ""


def sentence(*parts: str) -> str:
    """Join parts and end with one full stop."""
    text = "".join(parts).rstrip()
    return text if text.endswith(".") else text + "."
