"""Parameters of each action, validated per action.

One frozen pydantic model per action in the vocabulary. Unknown parameters
are rejected by name; defaults are filled in, and `Decision.params` carries
the filled-in dict (`params_dict`), so the applier never guesses a default.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, PlainValidator, model_validator
from pydantic_core import PydanticCustomError

from remedy.policies._types import NonNegFloat, NonNegInt, name_validator, number_validator
from remedy.policies._vocab import ACTIONS


class ActionParams(BaseModel):
    """Base of all parameter models: strict, immutable, no unknown keys."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


_OptPosFloat = Annotated[
    float | None, PlainValidator(number_validator(lo=0, lo_open=True, optional=True))
]
_OptOpenFraction = Annotated[
    float | None,
    PlainValidator(number_validator(lo=0, hi=1, lo_open=True, hi_open=True, optional=True)),
]
_OptFraction = Annotated[
    float | None, PlainValidator(number_validator(lo=0, hi=1, lo_open=True, optional=True))
]
_OptAboveOne = Annotated[
    float | None, PlainValidator(number_validator(lo=1, lo_open=True, optional=True))
]
_OptPosInt = Annotated[
    int | None, PlainValidator(number_validator(lo=1, integer=True, optional=True))
]
_Fraction = Annotated[
    float, PlainValidator(number_validator(lo=0, hi=1, lo_open=True, hi_open=True))
]


def _opt_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise PydanticCustomError("text", f"expected a string or null, got {value!r}")


def _opt_text_list(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise PydanticCustomError(
        "text_list", f"expected a non-empty list of names or null, got {value!r}"
    )


_OptText = Annotated[str | None, PlainValidator(_opt_text)]


class RollbackParams(ActionParams):
    """Go back to the snapshot `steps_back` steps ago and skip the next batches (`source: disk`:
    to a durable checkpoint only, passing over the `older` newest good ones)."""

    # `source: auto` takes the in-memory snapshots when they reach back that far, else a
    # durable checkpoint; `memory` never reads the disk; `disk` never the ring.
    steps_back: NonNegInt = 100
    skip_batches: NonNegInt = 0
    source: Literal["auto", "memory", "disk"] = "auto"
    older: NonNegInt = 0

    # Left out of the filled-in parameters at their defaults: the escalation ladder's
    # choices, which a policy's own rollback rarely names (its decisions read as before).
    sparse: ClassVar[frozenset[str]] = frozenset({"source", "older"})

    @model_validator(mode="after")
    def _older_on_disk(self) -> RollbackParams:
        if self.older and self.source != "disk":
            raise PydanticCustomError(
                "older_needs_disk", "`older` passes over durable checkpoints: add `source: disk`"
            )
        return self


class ShrinkLrParams(ActionParams):
    """Multiply the learning rate by `factor`, never below `min_lr`."""

    factor: _Fraction = 0.5
    min_lr: NonNegFloat = 0.0


class RescaleGradScalerParams(ActionParams):
    """Set (`scale`) or multiply (`factor`) the AMP loss scale; optionally retune growth."""

    scale: _OptPosFloat = None
    factor: _OptPosFloat = None
    growth_interval: _OptPosInt = None
    backoff_factor: _OptOpenFraction = None
    growth_factor: _OptAboveOne = None

    @model_validator(mode="after")
    def _one_of(self) -> RescaleGradScalerParams:
        if self.scale is not None and self.factor is not None:
            raise PydanticCustomError("conflict", "give `scale` or `factor`, not both")
        return self


class EnableActivationCheckpointingParams(ActionParams):
    """Wrap modules in activation checkpointing: by class name, name glob, or a fraction."""

    modules: Annotated[list[str] | None, PlainValidator(_opt_text_list)] = None
    pattern: _OptText = None
    fraction: _OptFraction = None


class SwitchKvAllocatorParams(ActionParams):
    """Switch the KV cache allocator."""

    to: Annotated[
        Literal["fixed", "pow2", "paged"],
        PlainValidator(name_validator(("fixed", "pow2", "paged"), "allocator")),
    ]


class RestartRankParams(ActionParams):
    """Kill and replace the ranks the decision names (no parameters)."""


class SkipBatchesParams(ActionParams):
    """Skip the next `count` batches."""

    count: Annotated[int, PlainValidator(number_validator(lo=1, integer=True))]


class ReduceMicrobatchParams(ActionParams):
    """Divide the micro-batch size by `factor` (gradient accumulation keeps the global batch)."""

    factor: Annotated[int, PlainValidator(number_validator(lo=2, integer=True))] = 2


def _opt_bool(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise PydanticCustomError("bool", f"expected true, false or null, got {value!r}")


class ConfigureCudaAllocatorParams(ActionParams):
    """Change the CUDA caching allocator's settings where the running torch allows it."""

    expandable_segments: Annotated[bool | None, PlainValidator(_opt_bool)] = None
    garbage_collection_threshold: _OptOpenFraction = None
    max_split_size_mb: _OptPosInt = None

    @model_validator(mode="after")
    def _some(self) -> ConfigureCudaAllocatorParams:
        if all(v is None for v in self.model_dump().values()):
            raise PydanticCustomError("empty", "name at least one allocator setting")
        return self


class CheckpointNowParams(ActionParams):
    """Write a durable checkpoint now (no parameters)."""


class DumpDiagnosticsParams(ActionParams):
    """Dump stacks, memory and recent metrics for a post-mortem (no parameters)."""


class NotifyParams(ActionParams):
    """Tell a person; the decision's reason is the default message."""

    message: _OptText = None


class AbortParams(ActionParams):
    """Stop the run (exit status 3); `reason` is shown to the user."""

    reason: _OptText = None


class ReplayStepParams(ActionParams):
    """Re-run the anomalous step from the state just before it and classify the fault.

    `tolerance`: 0 compares bitwise; above 0, the relative difference the loss
    and the gradient sums may show (for non-deterministic kernels).
    """

    tolerance: NonNegFloat = 0.0


ACTION_PARAMS: dict[str, type[ActionParams]] = {
    "rollback": RollbackParams,
    "shrink_lr": ShrinkLrParams,
    "rescale_grad_scaler": RescaleGradScalerParams,
    "enable_activation_checkpointing": EnableActivationCheckpointingParams,
    "switch_kv_allocator": SwitchKvAllocatorParams,
    "restart_rank": RestartRankParams,
    "skip_batches": SkipBatchesParams,
    "reduce_microbatch": ReduceMicrobatchParams,
    "checkpoint_now": CheckpointNowParams,
    "dump_diagnostics": DumpDiagnosticsParams,
    "notify": NotifyParams,
    "abort": AbortParams,
    "configure_cuda_allocator": ConfigureCudaAllocatorParams,
    "replay_step": ReplayStepParams,
}


# The action table (`_vocab.ACTION_TABLE`) names every action; each has its model here.
if set(ACTION_PARAMS) != set(ACTIONS):  # pragma: no cover - a broken table fails every import
    raise RuntimeError(
        f"action table and parameter models disagree: {sorted(set(ACTION_PARAMS) ^ set(ACTIONS))}"
    )


def params_dict(params: ActionParams) -> dict[str, Any]:
    """The JSON-able dict of an action's parameters, defaults filled in."""
    out = params.model_dump(mode="json")
    for name in getattr(params, "sparse", ()):
        if out[name] == type(params).model_fields[name].default:
            del out[name]
    return out
