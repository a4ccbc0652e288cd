"""The shape of a policy test file (`remedy policy test`), as pydantic models.

    policy: ../default.yaml        # relative to this file, or a bundled name
    step_seconds: 1.0              # event ts = step * step_seconds (for duration windows)
    tests:
      - name: nan storm rolls back once
        streams:
          rank0: {nonfinite_loss: "_x100 1x3 _x50"}
          rank1-7: {loss_spike: {pattern: "_x10 5.0", severity: critical, threshold: 2.0}}
        outcomes:                  # optional; every carried-out decision is otherwise "applied"
          - {step: 101, action: rollback, outcome: failed, detail: "no snapshot"}
        expect:
          - {step: 101, actions: [rollback, shrink_lr], rule: nan-rollback}
        no_decisions: [{from: 102, to: 150}]

Loaded with the same located diagnostics as policies.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, PlainValidator, Tag, ValidationError

from remedy.policies._diagnostics import sort_key
from remedy.policies._errors import diagnostics_from
from remedy.policies._limits import MAX_TEST_FILE_BYTES, decode
from remedy.policies._model import Strict, shape_tag
from remedy.policies._types import (
    ActionName,
    AnomalyKind,
    Bool,
    NonNegInt,
    SeverityName,
    SourceName,
    Text,
    name_validator,
    number_validator,
)
from remedy.policies._yaml import Document, load_yaml
from remedy.policies.exceptions import PolicyError


class StreamSpec(Strict):
    """A stream with event attributes beyond the pattern."""

    place: ClassVar[str] = "a stream"
    pattern: Text
    severity: SeverityName = "warning"
    threshold: Annotated[float | None, PlainValidator(number_validator(optional=True))] = None
    source: SourceName = "detector"
    node: Text | None = None  # the node the ranks ran on (for `group_by: [node]`)


StreamValue = Annotated[
    Annotated[Text, Tag("~str")] | Annotated[StreamSpec, Tag("~map")],
    Discriminator(
        shape_tag,
        custom_error_type="stream",
        custom_error_message='expected a pattern such as "_x100 1x3" or {pattern: ...}',
    ),
]


class OutcomeSpec(Strict):
    """What the runner records for the decisions of one action at one step."""

    place: ClassVar[str] = "an outcome"
    step: NonNegInt
    action: ActionName
    outcome: Annotated[
        Literal["applied", "failed", "none"],
        PlainValidator(name_validator(("applied", "failed", "none"), "outcome")),
    ]
    detail: Text = ""


class ExpectSpec(Strict):
    """What must have been decided at one step."""

    place: ClassVar[str] = "an expectation"
    step: NonNegInt
    actions: list[ActionName]
    rule: Text | None = None
    ranks: list[NonNegInt] | None = None
    params: dict[str, dict[str, Any]] | None = None
    suppressed: list[Text] | None = None
    reason_contains: Text | None = None


class RangeSpec(Strict):
    """A range of steps (inclusive) with no carried-out decision."""

    place: ClassVar[str] = "a step range"
    from_: NonNegInt = Field(alias="from")
    to: NonNegInt


class CaseSpec(Strict):
    """One named test: streams in, expectations out."""

    place: ClassVar[str] = "a test"
    name: Text
    streams: dict[str, dict[AnomalyKind, StreamValue]]
    start_step: NonNegInt = 1
    dry_run: Bool = False
    auto_apply: Bool = True
    outcomes: list[OutcomeSpec] = Field(default_factory=list)
    expect: list[ExpectSpec] = Field(default_factory=list)
    no_decisions: list[RangeSpec] = Field(default_factory=list)
    exhaustive: Bool = False


class TestFileSpec(Strict):
    """A policy test file."""

    __test__ = False  # not a pytest class
    place: ClassVar[str] = "the test file"
    policy: Text
    step_seconds: Annotated[float, PlainValidator(number_validator(lo=0, lo_open=True))] = 1.0
    tests: Annotated[list[CaseSpec], Field(min_length=1)]


def load_test_file(text: str | bytes, filename: str) -> tuple[TestFileSpec, Document]:
    """Parse and validate a test file (text or raw bytes); raise `PolicyError` with located
    diagnostics, whatever it holds."""
    noun = "policy test file"
    if isinstance(text, bytes):
        text = decode(text, filename, limit=MAX_TEST_FILE_BYTES, noun=noun)
    doc = load_yaml(text, filename, limit=MAX_TEST_FILE_BYTES, noun=noun)
    if not isinstance(doc.data, dict):
        raise PolicyError(
            [doc.error((), "a policy test file must be a mapping with `policy:` and `tests:`")]
        )
    try:
        spec = TestFileSpec.model_validate(doc.data)
    except ValidationError as exc:
        raise PolicyError(sorted(diagnostics_from(exc, doc, TestFileSpec), key=sort_key)) from None
    return spec, doc
