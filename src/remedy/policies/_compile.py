"""Compile a validated policy model into the engine's immutable `Policy`.

Pydantic has checked each key on its own; this module checks what spans
several keys (one action per step, a cooldown given twice, `count` without
`within`, escalations that name a missing rule, duplicate rule names) and
reports each problem at the exact key, then builds `Rule` objects.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from remedy.policies._diagnostics import Diagnostic
from remedy.policies._model import (
    ActionStep,
    InhibitModel,
    PolicyModel,
    Predicate,
    RuleModel,
    RuleRef,
    SinkModel,
)
from remedy.policies._notify import SINK_KINDS, NotifySink
from remedy.policies._params import ACTION_PARAMS, params_dict
from remedy.policies._predicates import Comparison, Matcher, combine
from remedy.policies._rules import Backoff, Escalation, Inhibit, Policy, Rule, Step, freeze
from remedy.policies._spans import Span
from remedy.policies._types import suggest
from remedy.policies._vocab import ACTIONS, severity_rank
from remedy.policies._yaml import Document, Path


def compile_policy(
    model: PolicyModel, doc: Document, default_name: str
) -> tuple[Policy, list[Diagnostic]]:
    """Build the `Policy`; return it with the errors found (the caller raises if any)."""
    errors: list[Diagnostic] = []
    names: dict[str, int] = {}
    rules: list[Rule] = []
    for index, rule_model in enumerate(model.rules):
        path: Path = ("rules", index)
        if rule_model.name in names:
            first = doc.locate(("rules", names[rule_model.name], "name"))[0]
            errors.append(
                doc.error(
                    (*path, "name"),
                    f"duplicate rule name {rule_model.name!r} (first defined on line {first}); "
                    "rule names must be unique",
                )
            )
        else:
            names[rule_model.name] = index
        rules.append(_rule(rule_model, path, doc, errors))
    targets: set[str] = set()
    for index, rule in enumerate(rules):
        targets.update(_check_refs(rule, ("rules", index), names, doc, errors))
    for index, rule in enumerate(rules):
        if rule.escalation_only and rule.name not in targets:
            errors.append(
                doc.error(
                    ("rules", index),
                    f"rule {rule.name!r} has no `when` and no rule escalates to it; "
                    "add `when:` or name it in an on_exhausted/on_failure",
                )
            )
    inhibit = tuple(_inhibit(m) for m in model.inhibit)
    sinks = [_sink(m, ("notify", i), doc, errors) for i, m in enumerate(model.notify)]
    policy = Policy(
        name=model.name or default_name,
        rules=tuple(rules),
        source_file=doc.file,
        dry_run=model.dry_run,
        inhibit=inhibit,
        description=model.description,
        notify=tuple(s for s in sinks if s is not None),
    )
    return policy, errors


def _rule(m: RuleModel, path: Path, doc: Document, errors: list[Diagnostic]) -> Rule:
    if m.when is None:
        preds: list[Predicate] = []
    else:
        preds = m.when if isinstance(m.when, list) else [m.when]
    if not preds and m.when is not None:
        errors.append(doc.error((*path, "when"), "when: needs at least one predicate"))
    for i, pred in enumerate(preds):
        if not pred.model_fields_set:
            where = (*path, "when", i) if isinstance(m.when, list) else (*path, "when")
            errors.append(
                doc.error(where, "when: an empty predicate matches every event; name an anomaly")
            )
    cooldown = m.cooldown
    if m.cooldown_steps is not None:
        if cooldown is not None:
            errors.append(
                doc.error(
                    (*path, "cooldown_steps"),
                    "give `cooldown` or `cooldown_steps`, not both",
                    key=True,
                )
            )
        cooldown = Span(float(m.cooldown_steps), "steps")
    if m.count > 1 and m.within is None:
        errors.append(
            doc.error(
                (*path, "count"),
                f"count: {m.count} needs a window: add `within:` (e.g. `within: 100`)",
            )
        )
    if m.fires_within is not None and m.max_fires is None:
        errors.append(
            doc.error(
                (*path, "fires_within"),
                "fires_within needs max_fires (e.g. `max_fires: 3`)",
                key=True,
            )
        )
    backoff = None
    if m.backoff is not None:
        b = m.backoff
        base = cooldown if cooldown is not None else b.initial
        if base is None:
            errors.append(
                doc.error(
                    (*path, "backoff"),
                    "backoff needs a cooldown to grow from: add `cooldown:` or `backoff.initial`",
                    key=True,
                )
            )
        elif b.max is not None and b.max.unit != base.unit:
            errors.append(
                doc.error(
                    (*path, "backoff", "max"),
                    f"backoff max must be in the same unit as the cooldown ({base.describe()})",
                )
            )
        backoff = Backoff(b.factor, b.initial, b.max, b.reset_after)
    steps = tuple(_step(item, (*path, "do", i), doc, errors) for i, item in enumerate(m.do))
    return Rule(
        name=m.name,
        # Without `when` the rule matches no event: it runs only when another rule escalates to it.
        matcher=combine([_matcher(p) for p in preds]) if preds else Matcher(kinds=frozenset()),
        escalation_only=m.when is None,
        steps=steps,
        description=m.description,
        count=m.count,
        within=m.within,
        persist=m.persist,
        group_by=tuple(m.group_by),
        cooldown=cooldown,
        max_fires=m.max_fires,
        fires_within=m.fires_within,
        on_exhausted=_escalation(m.on_exhausted),
        backoff=backoff,
        cont=m.continue_,
        line=doc.locate(path)[0],
    )


def _defaults(action: str, path: Path, doc: Document, errors: list[Diagnostic]) -> Any:
    """The parameters of an action written without any; an error if some are required."""
    try:
        return ACTION_PARAMS[action]()
    except ValidationError as exc:
        needed = sorted({str(e["loc"][0]) for e in exc.errors() if e["loc"]})
        errors.append(doc.error(path, f"{action} needs parameters: {', '.join(needed)}"))
        return ACTION_PARAMS["notify"]()


def _step(item: str | ActionStep, path: Path, doc: Document, errors: list[Diagnostic]) -> Step:
    if isinstance(item, str):
        return Step(item, freeze(params_dict(_defaults(item, path, doc, errors))))
    given = [name for name in ACTIONS if name in item.model_fields_set]
    if not given:
        errors.append(doc.error(path, f"a do step needs one action (valid: {', '.join(ACTIONS)})"))
        return Step("notify", freeze({"message": None}))
    if len(given) > 1:
        errors.append(
            doc.error(
                (*path, given[1]),
                f"one action per do step; {given[0]!r} and {given[1]!r} need two steps",
                key=True,
            )
        )
    action = given[0]
    params = getattr(item, action) or _defaults(action, path, doc, errors)
    on_failure = _escalation(item.on_failure) if item.on_failure is not None else None
    return Step(action, freeze(params_dict(params)), on_failure)


def _escalation(value: str | RuleRef) -> Escalation:
    if isinstance(value, RuleRef):
        return Escalation("rule", value.rule)
    if value == "next":
        return Escalation("next")
    return Escalation("notify") if value == "notify" else Escalation("abort")


def _check_refs(
    rule: Rule, path: Path, names: dict[str, int], doc: Document, errors: list[Diagnostic]
) -> set[str]:
    refs: list[tuple[Path, str]] = []
    if rule.on_exhausted.kind == "rule" and rule.on_exhausted.rule is not None:
        refs.append(((*path, "on_exhausted", "rule"), rule.on_exhausted.rule))
    for i, step in enumerate(rule.steps):
        if step.on_failure is not None and step.on_failure.rule is not None:
            refs.append(((*path, "do", i, "on_failure", "rule"), step.on_failure.rule))
    for where, target in refs:
        if target not in names:
            hint = _hint(target, list(names))
            errors.append(doc.error(where, f"no rule named {target!r}{hint}"))
    return {target for _where, target in refs}


def _hint(word: str, names: list[str]) -> str:
    return suggest(word, names) or (f" (rules: {', '.join(names)})" if names else "")


def _matcher(p: Predicate) -> Matcher:
    comparisons: list[tuple[str, Comparison]] = []
    for field in ("value", "threshold", "ratio", "step"):
        cmp: Any = getattr(p, field)
        if cmp is not None:
            comparisons.append((field, cmp))
    return Matcher(
        kinds=frozenset(p.anomaly) if p.anomaly is not None else None,
        min_severity=severity_rank(p.severity) if p.severity is not None else 0,
        ranks=frozenset(p.ranks) if p.ranks is not None else None,
        sources=frozenset(p.source) if p.source is not None else None,
        comparisons=tuple(comparisons),
    )


def _inhibit(m: InhibitModel) -> Inhibit:
    return Inhibit(m.while_, frozenset(m.anomalies), m.warmup_steps)


def _sink(m: SinkModel, path: Path, doc: Document, errors: list[Diagnostic]) -> NotifySink | None:
    given = [kind for kind in SINK_KINDS if kind in m.model_fields_set]
    if len(given) != 1:
        found = f"{len(given)}: {', '.join(given)}" if given else "none"
        errors.append(
            doc.error(
                path, f"a notify entry needs exactly one of {', '.join(SINK_KINDS)} ({found})"
            )
        )
        return None
    kind = given[0]
    line = doc.locate(path)[0]
    if m.command is not None:
        c = m.command
        return NotifySink("command", argv=tuple(c.argv), timeout_s=c.timeout_s,
                          attempts=c.attempts, line=line)  # fmt: skip
    http = m.webhook if m.webhook is not None else m.alertmanager
    assert http is not None
    if (http.url is None) == (http.url_env is None):
        errors.append(
            doc.error(
                (*path, kind),
                f"{kind} needs `url` or `url_env` (the variable that holds a secret URL), "
                "exactly one of them",
            )
        )
        return None
    if m.webhook is not None:
        return NotifySink("webhook", url=http.url, url_env=http.url_env, format=m.webhook.format,
                          timeout_s=http.timeout_s, attempts=http.attempts, line=line)  # fmt: skip
    assert m.alertmanager is not None
    return NotifySink("alertmanager", url=http.url, url_env=http.url_env,
                      labels=tuple(sorted(m.alertmanager.labels.items())),
                      timeout_s=http.timeout_s, attempts=http.attempts, line=line)  # fmt: skip
