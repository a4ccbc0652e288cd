"""The shape of a policy file, as pydantic models.

These models check types, names and ranges, key by key, and reject unknown
keys (`extra="forbid"`). Error locations follow the YAML paths exactly, so
each pydantic error maps back to a line and column (see `_errors`).
Cross-field rules (a cooldown given twice, a step with two actions, a
missing rule name in an escalation) are checked afterwards in `_compile`,
where positions of individual keys are at hand.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    field_validator,
)
from pydantic_core import PydanticCustomError

from remedy.policies._notify import (
    DEFAULT_ATTEMPTS,
    DEFAULT_TIMEOUT_S,
    Argv,
    Attempts,
    EnvName,
    Labels,
    Timeout,
    Url,
    WebhookFormat,
)
from remedy.policies._params import (
    AbortParams,
    CheckpointNowParams,
    ConfigureCudaAllocatorParams,
    DumpDiagnosticsParams,
    EnableActivationCheckpointingParams,
    NotifyParams,
    ReduceMicrobatchParams,
    ReplayStepParams,
    RescaleGradScalerParams,
    RestartRankParams,
    RollbackParams,
    ShrinkLrParams,
    SkipBatchesParams,
    SwitchKvAllocatorParams,
)
from remedy.policies._predicates import Comparison, parse_comparison
from remedy.policies._spans import Span, parse_span
from remedy.policies._types import (
    ActionName,
    AnomalyKind,
    Bool,
    NonNegInt,
    PosInt,
    SeverityName,
    SourceName,
    Text,
    name_validator,
    number_validator,
)

SpanT = Annotated[Span, PlainValidator(parse_span)]
CompareT = Annotated[Comparison, PlainValidator(parse_comparison)]
GROUP_FIELDS = ("kind", "step", "rank", "source", "severity", "node")


# The tags of the shape-discriminated unions: pydantic puts them in error locations,
# which drop them (a user's key spelt like one is still the user's: see _errors).
UNION_TAGS = frozenset({"~map", "~list", "~str"})


def shape_tag(value: Any) -> str | None:
    """Discriminate unions by YAML shape (one of `UNION_TAGS`), so error paths can drop them."""
    if isinstance(value, dict):
        return "~map"
    if isinstance(value, list):
        return "~list"
    if isinstance(value, str):
        return "~str"
    return None


def _listify(value: Any) -> Any:
    return [value] if isinstance(value, str | int) and not isinstance(value, bool) else value


class Strict(BaseModel):
    """Base of every policy model: strict types, no unknown keys, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=False)
    noun: ClassVar[str] = "key"
    place: ClassVar[str] = "here"


class RuleRef(Strict):
    """`{rule: NAME}`: hand over to another rule's chain."""

    noun: ClassVar[str] = "key"
    place: ClassVar[str] = "a rule reference"
    rule: Text


_FailureWord = Annotated[str, PlainValidator(name_validator(("next", "abort"), "on_failure"))]
_ExhaustWord = Annotated[str, PlainValidator(name_validator(("abort", "notify"), "on_exhausted"))]

OnFailure = Annotated[
    Annotated[_FailureWord, Tag("~str")] | Annotated[RuleRef, Tag("~map")],
    Discriminator(
        shape_tag,
        custom_error_type="on_failure",
        custom_error_message="expected next, abort or {rule: NAME}",
    ),
]
OnExhausted = Annotated[
    Annotated[_ExhaustWord, Tag("~str")] | Annotated[RuleRef, Tag("~map")],
    Discriminator(
        shape_tag,
        custom_error_type="on_exhausted",
        custom_error_message="expected abort, notify or {rule: NAME}",
    ),
]


class ActionStep(Strict):
    """One step of a `do` chain: exactly one `ACTION: {params}` key, plus `on_failure`."""

    noun: ClassVar[str] = "action"
    place: ClassVar[str] = "a do step"
    rollback: RollbackParams | None = None
    shrink_lr: ShrinkLrParams | None = None
    rescale_grad_scaler: RescaleGradScalerParams | None = None
    enable_activation_checkpointing: EnableActivationCheckpointingParams | None = None
    switch_kv_allocator: SwitchKvAllocatorParams | None = None
    restart_rank: RestartRankParams | None = None
    skip_batches: SkipBatchesParams | None = None
    reduce_microbatch: ReduceMicrobatchParams | None = None
    checkpoint_now: CheckpointNowParams | None = None
    dump_diagnostics: DumpDiagnosticsParams | None = None
    notify: NotifyParams | None = None
    abort: AbortParams | None = None
    configure_cuda_allocator: ConfigureCudaAllocatorParams | None = None
    replay_step: ReplayStepParams | None = None
    on_failure: OnFailure | None = None


StepItem = Annotated[
    Annotated[ActionName, Tag("~str")] | Annotated[ActionStep, Tag("~map")],
    Discriminator(
        shape_tag,
        custom_error_type="step",
        custom_error_message="expected an action name or a mapping {ACTION: {params}}",
    ),
]


class Predicate(Strict):
    """One mapping of a `when` clause; every key given must hold."""

    noun: ClassVar[str] = "predicate"
    place: ClassVar[str] = "a when clause"
    anomaly: list[AnomalyKind] | None = None
    severity: SeverityName | None = None
    ranks: list[NonNegInt] | None = None
    source: list[SourceName] | None = None
    value: CompareT | None = None
    threshold: CompareT | None = None
    ratio: CompareT | None = None
    step: CompareT | None = None

    _one_or_many = field_validator("anomaly", "ranks", "source", mode="before")(_listify)


When = Annotated[
    Annotated[Predicate, Tag("~map")] | Annotated[list[Predicate], Tag("~list")],
    Discriminator(
        shape_tag,
        custom_error_type="when",
        custom_error_message="expected a predicate mapping or a list of them",
    ),
]


class Backoff(Strict):
    """Exponential back-off of a rule's cooldown between repeated firings."""

    noun: ClassVar[str] = "key"
    place: ClassVar[str] = "backoff"
    factor: Annotated[float, PlainValidator(number_validator(lo=1, lo_open=True))] = 2.0
    initial: SpanT | None = None
    max: SpanT | None = None
    reset_after: SpanT | None = None


class RuleModel(Strict):
    """One rule: when to act, what to do, and how often."""

    noun: ClassVar[str] = "key"
    place: ClassVar[str] = "a rule"
    name: Text
    description: Text | None = None
    when: When | None = None
    count: PosInt = 1
    within: SpanT | None = None
    persist: PosInt = 1
    group_by: list[
        Annotated[str, PlainValidator(name_validator(GROUP_FIELDS, "group_by field"))]
    ] = Field(default_factory=lambda: ["kind", "step"])
    do: Annotated[list[StepItem], Field(min_length=1)]
    cooldown: SpanT | None = None
    cooldown_steps: NonNegInt | None = None
    max_fires: PosInt | None = None
    fires_within: SpanT | None = None
    on_exhausted: OnExhausted = "abort"
    backoff: Backoff | None = None
    continue_: Bool = Field(default=False, alias="continue")


class InhibitModel(Strict):
    """While an action is in flight (and `warmup_steps` after), the named anomalies fire nothing."""

    noun: ClassVar[str] = "key"
    place: ClassVar[str] = "an inhibit entry"
    while_: ActionName = Field(alias="while")
    anomalies: list[AnomalyKind]
    warmup_steps: NonNegInt = 0

    _one_or_many = field_validator("anomalies", mode="before")(_listify)


class _HttpSink(Strict):
    """A sink reached over HTTP: its URL, or the environment variable that holds it."""

    noun: ClassVar[str] = "key"
    url: Url | None = None
    url_env: EnvName | None = None
    timeout_s: Timeout = DEFAULT_TIMEOUT_S
    attempts: Attempts = DEFAULT_ATTEMPTS


class WebhookSink(_HttpSink):
    """POST a JSON body: remedy's own (`generic`) or a Slack-compatible `{"text": ...}`."""

    place: ClassVar[str] = "a webhook sink"
    format: WebhookFormat = "generic"


class AlertmanagerSink(_HttpSink):
    """POST alerts to Prometheus Alertmanager's `/api/v2/alerts`."""

    place: ClassVar[str] = "an alertmanager sink"
    labels: Labels = Field(default_factory=dict)


class CommandSink(Strict):
    """Run a program with the notification as JSON on its stdin."""

    noun: ClassVar[str] = "key"
    place: ClassVar[str] = "a command sink"
    argv: Argv
    timeout_s: Timeout = DEFAULT_TIMEOUT_S
    attempts: Attempts = DEFAULT_ATTEMPTS


class SinkModel(Strict):
    """One entry of `notify:`: exactly one of `webhook`, `alertmanager`, `command`."""

    noun: ClassVar[str] = "sink"
    place: ClassVar[str] = "a notify entry"
    webhook: WebhookSink | None = None
    alertmanager: AlertmanagerSink | None = None
    command: CommandSink | None = None


def _version(value: Any) -> int:
    if value == 1 and not isinstance(value, bool):
        return 1
    raise PydanticCustomError("version", f"unsupported policy version {value!r}; use `version: 1`")


class PolicyModel(Strict):
    """The whole policy file."""

    noun: ClassVar[str] = "key"
    place: ClassVar[str] = "the policy"
    version: Annotated[Literal[1], PlainValidator(_version)]
    name: Text | None = None
    description: Text | None = None
    dry_run: Bool = False
    inhibit: list[InhibitModel] = Field(default_factory=list)
    notify: list[SinkModel] = Field(default_factory=list)
    rules: list[RuleModel]
