"""Which loop a policy will run under, and the steps that loop cannot carry out.

A policy's actions are applied by the loop that trains: the `Guard`
(`guard`, the default: every action of the table) or the Hugging Face and
Lightning callbacks (`callbacks`), which leave the loop to the framework
and cannot take the actions whose row of `_vocab.ACTION_TABLE` gives an
`under_callbacks` sentence. `remedy policy check --loop callbacks` reports
each step of such an action as an error with that sentence (the same one a
failed outcome gives there at run time), so a policy meant for a framework's
loop is refused before the run rather than failing step by step in it.

A bundled policy is written for the Guard; `for_loop` gives its version for
the callbacks, without the steps they cannot take (`checkpoint_now`,
`reduce_microbatch`, `replay_step`), so it runs there without a warning and
without failed outcomes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final, Literal

from remedy.policies._diagnostics import Diagnostic
from remedy.policies._rules import Policy
from remedy.policies._vocab import ACTION_SPECS
from remedy.policies._yaml import Document

Loop = Literal["guard", "callbacks"]
LOOPS: Final[tuple[Loop, ...]] = ("guard", "callbacks")


@dataclass(frozen=True, slots=True)
class RefusedStep:
    """One step of a rule that `loop` cannot carry out, and why (the table's sentence)."""

    rule_index: int
    rule: str
    step_index: int
    action: str
    why: str

    def describe(self) -> str:
        """The diagnostic's message."""
        return (
            f"rule {self.rule!r}, step {self.step_index + 1}: {self.action} is not applied "
            f"under the Hugging Face and Lightning callbacks: {self.why}"
        )


def refused_steps(policy: Policy, loop: Loop) -> list[RefusedStep]:
    """The steps of `policy`'s rules that `loop` refuses, in rule and step order."""
    if loop == "guard":
        return []
    out = []
    for r, rule in enumerate(policy.rules):
        for s, step in enumerate(rule.steps):
            why = ACTION_SPECS[step.action].under_callbacks
            if why is not None:
                out.append(RefusedStep(r, rule.name, s, step.action, why))
    return out


def loop_diagnostics(policy: Policy, doc: Document, loop: Loop) -> list[Diagnostic]:
    """One error per refused step, located at the step's action in the file."""
    return [
        doc.error(("rules", x.rule_index, "do", x.step_index, x.action), x.describe(), key=True)
        for x in refused_steps(policy, loop)
    ]


def for_loop(policy: Policy, loop: Loop) -> Policy:
    """`policy` without the steps `loop` refuses: a bundled policy's version for a loop.

    A rule left with no step is dropped (its anomalies go on to the next rule that
    matches), unless another rule escalates to it: that one keeps its steps, refused
    ones included, and `refused_steps` still names them.
    """
    refused = refused_steps(policy, loop)
    if not refused:
        return policy
    drop = {(x.rule_index, x.step_index) for x in refused}
    targets = {
        esc.rule
        for rule in policy.rules
        for esc in (rule.on_exhausted, *(st.on_failure for st in rule.steps))
        if esc is not None and esc.kind == "rule"
    }
    rules = []
    for r, rule in enumerate(policy.rules):
        steps = tuple(st for s, st in enumerate(rule.steps) if (r, s) not in drop)
        if not steps:
            if rule.name in targets:
                rules.append(rule)
            continue
        rules.append(dataclasses.replace(rule, steps=steps))
    return dataclasses.replace(policy, rules=tuple(rules))
