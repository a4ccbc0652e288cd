"""Semantic lints: policies that load but probably do not do what their author meant.

Each finding is a warning (an error under `check --strict`): a rule that
can never fire because an earlier, broader rule claims its events; a
cooldown shorter than the rule's own counting window; escalations that go
round in a cycle; `on_failure: next` on the last step; `on_exhausted`
without `max_fires`.
"""

from __future__ import annotations

from remedy.policies._diagnostics import Diagnostic
from remedy.policies._rules import Policy, Rule
from remedy.policies._yaml import Document


def lint(policy: Policy, doc: Document) -> list[Diagnostic]:
    """All lint warnings for a compiled policy, located in its document."""
    found: list[Diagnostic] = []
    rules = policy.rules
    targets = {t for r in rules for t in _targets(r)}
    for index, rule in enumerate(rules):
        path = ("rules", index)
        # A rule reached only by escalation may repeat an earlier rule's `when` on purpose.
        shadow = None if rule.name in targets else _shadowed_by(rule, rules[:index])
        if shadow is not None:
            found.append(
                doc.warning(
                    (*path, "name"),
                    f"rule {rule.name!r} can never fire: rule {shadow.name!r} (line {shadow.line}) "
                    "matches every event it matches and has no `continue: true`",
                )
            )
        if rule.cooldown is not None and rule.within is not None and rule.count > 1:
            same_unit = rule.cooldown.unit == rule.within.unit
            if same_unit and rule.cooldown.amount < rule.within.amount:
                found.append(
                    doc.warning(
                        (*path, "cooldown" if "cooldown" in _keys(doc, path) else "cooldown_steps"),
                        f"cooldown ({rule.cooldown.describe()}) is shorter than the rule's window "
                        f"within: {rule.within.describe()}; events from before a firing may "
                        "count towards the next one; make the cooldown at least the window",
                    )
                )
        last = rule.steps[-1]
        if last.on_failure is not None and last.on_failure.kind == "next":
            found.append(
                doc.warning(
                    (*path, "do", len(rule.steps) - 1, "on_failure"),
                    "on_failure: next on the last step has no next step; use abort or {rule: NAME}",
                )
            )
        if rule.max_fires is None and "on_exhausted" in _keys(doc, path):
            found.append(
                doc.warning(
                    (*path, "on_exhausted"),
                    "on_exhausted has no effect without max_fires",
                    key=True,
                )
            )
    found.extend(_cycles(policy, doc))
    return found


def _keys(doc: Document, path: tuple[str | int, ...]) -> set[str]:
    node = doc.data
    for part in path:
        node = node[part]
    return set(node) if isinstance(node, dict) else set()


def _shadowed_by(rule: Rule, earlier: tuple[Rule, ...]) -> Rule | None:
    """An earlier rule that claims every event `rule` would see, if any."""
    for other in earlier:
        unconditional = other.count == 1 and other.persist == 1
        if not other.cont and unconditional and other.matcher.covers(rule.matcher):
            return other
    return None


def _targets(rule: Rule) -> list[str]:
    out = []
    if rule.max_fires is not None and rule.on_exhausted.rule is not None:
        out.append(rule.on_exhausted.rule)
    out.extend(s.on_failure.rule for s in rule.steps if s.on_failure and s.on_failure.rule)
    return out


def _cycles(policy: Policy, doc: Document) -> list[Diagnostic]:
    """One warning per escalation cycle (a rule that escalates, eventually, to itself)."""
    graph = {r.name: _targets(r) for r in policy.rules}
    index = {r.name: i for i, r in enumerate(policy.rules)}
    reported: set[frozenset[str]] = set()
    found: list[Diagnostic] = []
    for start in graph:
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in graph.get(node, []):
                if nxt == start:
                    members = frozenset(trail)
                    if members not in reported:
                        reported.add(members)
                        cycle = " -> ".join([*trail, start])
                        found.append(
                            doc.warning(
                                ("rules", index[start], "name"),
                                f"escalation cycle: {cycle}; end the chain with abort or notify",
                            )
                        )
                elif nxt not in trail and nxt in graph:
                    stack.append((nxt, [*trail, nxt]))
    return found
