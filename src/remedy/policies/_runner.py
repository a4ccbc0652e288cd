"""Run policy test files (`remedy policy test`), in the manner of `promtool test rules`.

Each test builds its synthetic streams, runs them through a fresh engine
(`policies.testing.run_stream`: one batch per step, every carried-out
decision recorded as applied at the step it was made unless `outcomes`
says otherwise) and compares what was decided with `expect` and
`no_decisions`. Failures print expected against got, step by step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from remedy.policies._diagnostics import Diagnostic
from remedy.policies._events import AnomalyEvent, Decision
from remedy.policies._limits import MAX_TEST_FILE_BYTES, read_bounded
from remedy.policies._loader import BUNDLED, bundled_policy_path, load_policy
from remedy.policies._rules import Policy
from remedy.policies._streams import MAX_TEST_EVENTS, parse_ranks, pattern_events
from remedy.policies._testfile import CaseSpec, ExpectSpec, TestFileSpec, load_test_file
from remedy.policies._yaml import Document
from remedy.policies.exceptions import PolicyError, PolicyTestError
from remedy.policies.testing import run_stream


@dataclass
class CaseResult:
    """The outcome of one test: passed, or the lines that explain why not."""

    name: str
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every expectation held."""
        return not self.failures


@dataclass
class FileResult:
    """The outcome of one test file: its tests' results, or why it could not run."""

    file: str
    cases: list[CaseResult] = field(default_factory=list)
    errors: list[Diagnostic] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when the file ran and every test passed."""
        return not self.errors and all(c.passed for c in self.cases)

    def report(self) -> list[str]:
        """Human-readable lines: failures with their diffs, then a summary."""
        if self.errors:
            return [d.format() for d in self.errors]
        lines: list[str] = []
        for case in self.cases:
            if not case.passed:
                lines.append(f"FAIL {self.file}: {case.name}")
                lines.extend(f"  {line}" for line in case.failures)
        failed = sum(not c.passed for c in self.cases)
        total = len(self.cases)
        if failed:
            lines.append(f"{self.file}: {failed} of {total} tests failed")
        else:
            lines.append(f"{self.file}: {total} tests passed")
        return lines


def run_test_file(path: str | os.PathLike[str]) -> FileResult:
    """Load a test file and the policy it names, and run every test in it."""
    file = Path(path)
    result = FileResult(str(file))
    try:
        data = read_bounded(file, limit=MAX_TEST_FILE_BYTES, noun="test file")
        spec, doc = load_test_file(data, str(file))
        policy = load_policy(_policy_path(spec.policy, file))
    except PolicyError as exc:
        result.errors.extend(exc.diagnostics)
        return result
    for index, case in enumerate(spec.tests):
        try:
            events = _events(case, index, spec, doc)
        except PolicyError as exc:
            result.errors.extend(exc.diagnostics)
            continue
        result.cases.append(run_case(policy, case, events))
    return result


def _policy_path(name: str, test_file: Path) -> Path:
    candidate = test_file.parent / name
    if name in BUNDLED and not candidate.exists():
        return bundled_policy_path(name)
    return candidate


def _events(case: CaseSpec, index: int, spec: TestFileSpec, doc: Document) -> list[AnomalyEvent]:
    events: list[AnomalyEvent] = []
    for key, kinds in case.streams.items():
        where = ("tests", index, "streams", key)
        try:
            ranks = parse_ranks(key)
        except PolicyTestError as exc:
            raise PolicyError([doc.error(where, str(exc), key=True)]) from None
        for kind, value in kinds.items():
            pattern, extra = (value, {}) if isinstance(value, str) else (value.pattern, value)
            try:
                events.extend(
                    pattern_events(
                        kind,
                        pattern,
                        ranks,
                        start_step=case.start_step,
                        severity=getattr(extra, "severity", "warning"),
                        threshold=getattr(extra, "threshold", None),
                        source=getattr(extra, "source", "detector"),
                        node=getattr(extra, "node", None),
                        step_seconds=spec.step_seconds,
                    )
                )
            except PolicyTestError as exc:
                raise PolicyError([doc.error((*where, kind), str(exc))]) from None
            if len(events) > MAX_TEST_EVENTS:
                message = f"the streams of this test make more than {MAX_TEST_EVENTS} events"
                raise PolicyError([doc.error((*where, kind), message)])
    return events


def run_case(policy: Policy, case: CaseSpec, events: list[AnomalyEvent]) -> CaseResult:
    """Run one test's events through a fresh engine and check its expectations."""
    outcomes = {(o.step, o.action): (o.outcome, o.detail) for o in case.outcomes}
    decisions = run_stream(
        policy,
        events,
        dry_run=case.dry_run,
        auto_apply=case.auto_apply,
        outcomes=outcomes,
    )
    result = CaseResult(case.name)
    acted = [d for d in decisions if not d.suppressed]
    for expect in case.expect:
        result.failures.extend(_check(expect, acted, decisions))
    for span in case.no_decisions:
        stray = [d for d in acted if span.from_ <= d.step <= span.to]
        if stray:
            result.failures.append(f"steps {span.from_}-{span.to}: expected no decisions, got:")
            result.failures.extend(_describe(stray))
    if case.exhaustive:
        listed = {e.step for e in case.expect}
        stray = [d for d in acted if d.step not in listed]
        if stray:
            result.failures.append("decisions at steps no expectation lists (exhaustive: true):")
            result.failures.extend(_describe(stray))
    return result


def _check(expect: ExpectSpec, acted: list[Decision], everything: list[Decision]) -> list[str]:
    got = [d for d in acted if d.step == expect.step]
    problems: list[str] = []
    actions = [d.action for d in got]
    if actions != expect.actions:
        problems.append(
            f"actions: expected [{', '.join(expect.actions)}], got [{', '.join(actions)}]"
        )
    if expect.rule is not None and any(d.rule != expect.rule for d in got):
        rules = sorted({d.rule for d in got})
        problems.append(f"rule: expected {expect.rule}, got {', '.join(rules) or 'nothing'}")
    if expect.ranks is not None and got and list(got[0].ranks) != sorted(expect.ranks):
        problems.append(f"ranks: expected {sorted(expect.ranks)}, got {list(got[0].ranks)}")
    for action, params in (expect.params or {}).items():
        match = next((d for d in got if d.action == action), None)
        wrong = {k: v for k, v in params.items() if match is None or match.params.get(k) != v}
        if wrong:
            have = dict(match.params) if match is not None else "no such decision"
            problems.append(f"params of {action}: expected {params}, got {have}")
    if expect.suppressed is not None:
        held = sorted(d.rule for d in everything if d.suppressed and d.step == expect.step)
        if held != sorted(expect.suppressed):
            problems.append(f"suppressed rules: expected {sorted(expect.suppressed)}, got {held}")
    text = expect.reason_contains
    if text is not None and not any(text in d.reason for d in got):
        problems.append(f"no reason contains {text!r}")
    if not problems:
        return []
    return [f"step {expect.step}:", *(f"  {p}" for p in problems), *_describe(got, indent=4)]


def _describe(decisions: list[Decision], indent: int = 2) -> list[str]:
    pad = " " * indent
    return [f"{pad}step {d.step}: {d.action} [{d.rule}] {d.reason}" for d in decisions]
