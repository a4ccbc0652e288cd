"""`remedy explain`: why a decision was taken, and what a rule did over a run.

Everything comes from the run directory: the journal holds every decision,
suppressed ones included with their reason (cooldown, inhibition, budget,
max_fires), the anomalies and the per-step metrics. The rule's predicates
are re-evaluated against the events with the pure policy package, so the
explanation shows the value each one saw.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from remedy.policies import (
    AnomalyEvent,
    EventError,
    Policy,
    PolicyError,
    Rule,
    load_policy,
    merged_text,
)
from remedy.policies._predicates import COMPARABLE_FIELDS, _field
from remedy.policies._vocab import severity_rank
from remedy.report import ladder_text
from remedy.report.deaths import death_lines
from remedy.rundir.rundata import RunData, number

# Executed steps averaged for "loss before" and "loss after".
LOSS_WINDOW = 10


def explain(
    run: RunData, *, step: int | None = None, decision: str | None = None, rule: str | None = None
) -> str:
    """The text for one of: a decision by id, the decisions at a step, a rule; else an overview.

    A damaged journal is explained as far as it goes: lines that are no decision (no
    id: torn, or another record's shape) are left out, and what could not be read is
    named after the text.
    """
    run, nameless = _readable(run)
    policy = _policy(run)
    if decision is not None:
        text = explain_decision(run, _find_decision(run, decision), policy)
    elif step is not None:
        found = [d for d in run.decisions if d.get("step") == step]
        if not found:
            steps = sorted({d["step"] for d in run.decisions if isinstance(d.get("step"), int)})
            raise LookupError(f"no decision at step {step}; decisions were taken at steps {steps}")
        text = "\n\n".join(explain_decision(run, d, policy) for d in found)
    elif rule is not None:
        text = explain_rule(run, rule, policy)
    else:
        text = "\n".join([_overview(run), *death_lines(run.path)])
    notes = list(run.problems)
    if nameless:
        notes.append(
            f"{run.path / 'decisions.jsonl'}: {nameless} line(s) without a decision id skipped"
        )
    return text + "".join(f"\nnote: {n}" for n in notes)


def _readable(run: RunData) -> tuple[RunData, int]:
    """`run` with only the decisions that have an id, each field of the shape the text
    expects (a wrong one is dropped), and how many lines had no id."""
    kept = [
        _shaped(d)
        for d in run.decisions
        if isinstance(d.get("decision_id"), str) and d["decision_id"]
    ]
    return dataclasses.replace(run, decisions=kept), len(run.decisions) - len(kept)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _shaped(d: dict[str, Any]) -> dict[str, Any]:
    out = dict(d)
    for key in ("anomaly", "params"):
        if not isinstance(out.get(key), dict):
            out[key] = {}
    anomaly = out["anomaly"] = dict(out["anomaly"])
    for key in ("rank", "step", "tick"):
        if key in anomaly and _int_or_none(anomaly[key]) is None:
            del anomaly[key]
    chain = out.get("chain")
    if isinstance(chain, dict):
        length, index = _int_or_none(chain.get("length")), _int_or_none(chain.get("index"))
        out["chain"] = {
            "id": chain.get("id") if isinstance(chain.get("id"), str) else None,
            "length": length if length is not None else 1,
            "index": index if index is not None else 0,
        }
    else:
        out["chain"] = {}
    for key in ("applied_at_step", "apply_at_step"):
        out[key] = _int_or_none(out.get(key))
    if number(out.get("latency_s")) is None:
        out["latency_s"] = None
    return out


def _policy(run: RunData) -> Policy | None:
    """The run's policy, when the summary names one that still loads."""
    name = run.summary.get("policy")
    if not isinstance(name, str):
        return None
    try:
        return load_policy(name)
    except (PolicyError, OSError):
        return None


def _find_decision(run: RunData, ident: str) -> dict[str, Any]:
    found = [d for d in run.decisions if str(d.get("decision_id", "")).endswith(ident)]
    if len(found) != 1:
        ids = ", ".join(str(d.get("decision_id")) for d in run.decisions) or "none"
        what = "no decision" if not found else f"{len(found)} decisions"
        raise LookupError(f"{what} with id {ident!r} in {run.path}; ids: {ids}")
    return found[0]


def _overview(run: RunData) -> str:
    n = len(run.decisions)
    if not n:
        return f"no decisions in {run.path}"
    lines = [
        f"{n} decision{'s' if n != 1 else ''} in {run.path}; ask about one with --decision ID:"
    ]
    for d in run.decisions:
        lines.append(
            f"  {d.get('decision_id')}  step {d.get('step')}  {d.get('rule')}: "
            f"{d.get('action')} [{d.get('outcome')}]"
        )
    lines.extend(ladder_text.overview_lines(run.decisions))
    return "\n".join(lines)


# --------------------------------------------------------------- decisions
def explain_decision(run: RunData, d: dict[str, Any], policy: Policy | None) -> str:
    """The events behind one decision, the rule's predicates on them, what was done, what followed."""
    anomaly = d.get("anomaly") or {}
    chain = d.get("chain") or {}
    lines = [
        (
            f"decision {d.get('decision_id')}: {d.get('action')} at step {d.get('step')}, "
            f"rule {d.get('rule')!r}, outcome {d.get('outcome')}"
        ),
        f"  reason: {d.get('reason')}",
        "events that led to it:",
    ]
    for ev in _events_for(run, d):
        lines.append("  - " + _event_text(ev))
    merged = merged_text(anomaly)
    if merged is not None:
        lines.append("  " + merged)
    climbed = ladder_text.decision_line(d)
    if climbed is not None:
        lines.append("  " + climbed)
    rule = policy.rule(str(d.get("rule"))) if policy is not None else None
    if rule is None:
        lines.append(
            f"rule {d.get('rule')!r}: not in the run's policy as it loads now; predicates not re-evaluated"
        )
    else:
        lines.append(
            f"rule {rule.name!r} ({policy.source_file if policy else '?'}, line {rule.line}):"
        )
        lines.extend("  " + text for text in predicate_lines(rule, anomaly))
        lines.append("  " + _limits(rule))
    lines.extend(evidence_lines(d))
    lines.append("what was done:")
    lines.append(f"  {d.get('action')} {d.get('params') or {}} -> {d.get('outcome')}")
    if d.get("detail"):
        lines.append(f"  {d['detail']}")
    lines.extend("  " + text for text in _deliveries(run, d))
    if d.get("applied_at_step") is not None:
        lines.append(
            f"  applied at step {d['applied_at_step']} (asked for {d.get('apply_at_step')}), "
            f"{d.get('latency_s')} s after the decision"
        )
    if chain.get("length", 1) > 1:
        mates = [
            x
            for x in run.decisions
            if (x.get("chain") or {}).get("id") == chain.get("id") and x is not d
        ]
        lines.append(
            f"  step {chain.get('index', 0) + 1} of a chain of {chain.get('length')}; the others: "
            + "; ".join(f"{x.get('action')} [{x.get('outcome')}]" for x in mates)
        )
    lines.append("what training did next:")
    lines.extend("  " + text for text in _loss_around(run, d))
    return "\n".join(lines)


def _deliveries(run: RunData, d: dict[str, Any]) -> list[str]:
    """How a notify decision's deliveries ended, one line per sink."""
    out = []
    for n in run.notifications:
        if n.get("decision_id") != d.get("decision_id"):
            continue
        tries = n.get("attempts")
        if n.get("outcome") == "delivered":
            word = "try" if tries == 1 else "tries"
            out.append(f"delivered to {n.get('sink')} ({tries} {word}, {n.get('latency_s')} s)")
        else:
            out.append(f"not delivered to {n.get('sink')}: {n.get('error')}")
    return out


def _events_for(run: RunData, d: dict[str, Any]) -> list[dict[str, Any]]:
    """The journaled anomalies of the decision's kind and step (every rank that saw it)."""
    anomaly = d.get("anomaly") or {}
    kind, step = anomaly.get("kind"), anomaly.get("step", d.get("step"))
    found = [a for a in run.anomalies if a.get("kind") == kind and a.get("step") == step]
    return found or ([anomaly] if anomaly else [])


def _event_text(ev: dict[str, Any]) -> str:
    value = ev.get("value")
    details = ev.get("details")
    node = details.get("node") if isinstance(details, dict) else None
    where = f"rank {ev.get('rank')}" + (f" (node {node})" if isinstance(node, str) else "")
    parts = [
        f"{ev.get('kind')} on {where} at step {ev.get('step')} (tick {ev.get('tick')})",
        f"value {value}" if value is not None else "",
        f"threshold {ev.get('threshold')}" if ev.get("threshold") is not None else "",
        f"{ev.get('severity')}, from {ev.get('source')}",
    ]
    return ", ".join(p for p in parts if p)


REPLAY_ANSWERS = ("replay_reproducible", "replay_transient", "replay_rank_specific")


def evidence_lines(d: dict[str, Any]) -> list[str]:
    """What a replay or the replica check compared, for the decision it led to or made."""
    anomaly = d.get("anomaly") or {}
    details = anomaly.get("details")
    details = details if isinstance(details, dict) else {}
    result = d.get("result")
    verdict = result.get("verdict") if isinstance(result, dict) else None
    if d.get("action") == "replay_step" and isinstance(verdict, dict):
        return _replay_lines(verdict.get("kind"), verdict.get("rank"), verdict)
    if anomaly.get("kind") in REPLAY_ANSWERS:
        return _replay_lines(anomaly.get("kind"), anomaly.get("rank"), details)
    if anomaly.get("kind") == "replica_divergence":
        return _divergence_lines(anomaly.get("rank"), details)
    return []


def _replay_lines(kind: Any, rank: Any, found: dict[str, Any]) -> list[str]:
    ev = found.get("evidence")
    if not isinstance(ev, dict):
        return []
    checked = (
        f"rank {ev.get('suspect')}'s batch checked on rank {ev.get('witness')}"
        if ev.get("witness") is not None
        else "no other rank asked (the re-run showed it, or there is none)"
    )
    lines = [
        f"the replay's evidence ({kind} on rank {rank}):",
        f"  {found.get('reason')}",
        (
            f"  step {ev.get('step')} re-run on every rank from the state rank "
            f"{ev.get('source')} kept before its update; {checked}; tolerance "
            f"{ev.get('tolerance')} ({'bitwise' if not ev.get('tolerance') else 'relative'})"
        ),
    ]
    rows = ev.get("ranks")
    for r, row in rows.items() if isinstance(rows, dict) else []:
        if not isinstance(row, dict):
            continue
        loss, grads = _pair(row.get("loss")), _pair(row.get("grads"))
        kept = ", kept the state" if row.get("kept") else ""
        lines.append(
            f"  rank {r}{kept}: loss {loss[0]} then {loss[1]} on the re-run; "
            f"gradients {grads[0]} then {grads[1]}"
        )
    check = ev.get("witness_check")
    if isinstance(check, dict):
        loss, grads = _pair(check.get("loss")), _pair(check.get("grads"))
        lines.append(
            f"  rank {check.get('batch_of')}'s batch alone: on rank {ev.get('suspect')} loss "
            f"{loss[0]}, gradients {grads[0]}; on rank {ev.get('witness')} loss {loss[1]}, "
            f"gradients {grads[1]}"
        )
    if ev.get("first_difference"):
        lines.append(f"  first gradient that differs: {ev['first_difference']}")
    if ev.get("replay_s") is not None:
        lines.append(f"  the replay took {ev['replay_s']} s")
    return lines


def _divergence_lines(rank: Any, details: dict[str, Any]) -> list[str]:
    lines = [
        (
            f"the replica check's evidence (rank {rank} odd among ranks {details.get('group')}, "
            f"reference rank {details.get('reference')}, checked every "
            f"{details.get('checked_every')} steps, last agreed at step "
            f"{details.get('last_agreed_step')}):"
        )
    ]
    digests = details.get("digests")
    for r, row in digests.items() if isinstance(digests, dict) else []:
        if isinstance(row, dict):
            lines.append(
                f"  rank {r}: parameters {row.get('params')}, optimizer state {row.get('optimizer')}"
            )
    if details.get("first_difference"):
        lines.append(f"  first tensor that differs: {details['first_difference']}")
    return lines


def _pair(value: Any) -> tuple[Any, Any]:
    """A journaled [original, re-run] pair, whatever the line holds."""
    if isinstance(value, list) and len(value) == 2:
        return value[0], value[1]
    return None, None


def _as_event(raw: dict[str, Any]) -> AnomalyEvent | None:
    try:
        return AnomalyEvent.from_dict(
            {k: v for k, v in raw.items() if k not in ("event", "run_id", "detected_at")}
        )
    except EventError:
        return None


def predicate_lines(rule: Rule, raw: dict[str, Any]) -> list[str]:
    """Each predicate of the rule's `when`, the value it saw in the event, and whether it held."""
    m = rule.matcher
    ev = _as_event(raw)
    if ev is None:
        return ["(the journaled event could not be read back; predicates not re-evaluated)"]
    out: list[str] = []

    def say(name: str, seen: Any, want: str, held: bool) -> None:
        out.append(f"{name}: {seen} {want} -> {'holds' if held else 'does not hold'}")

    if rule.escalation_only:
        out.append("no `when`: reached only by escalation from another rule")
    if m.kinds is not None:
        say("anomaly", ev.kind, f"in {sorted(m.kinds)}", ev.kind in m.kinds)
    if m.min_severity:
        want = next(
            s for s in ("info", "warning", "critical") if severity_rank(s) == m.min_severity
        )
        say("severity", ev.severity, f">= {want}", severity_rank(ev.severity) >= m.min_severity)
    if m.ranks is not None:
        say("ranks", ev.rank, f"in {sorted(m.ranks)}", ev.rank in m.ranks)
    if m.sources is not None:
        say("source", ev.source, f"in {sorted(m.sources)}", ev.source in m.sources)
    for name, cmp in m.comparisons:
        assert name in COMPARABLE_FIELDS
        seen = _field(ev, name)
        say(name, "none" if seen is None else f"{seen:g}", cmp.describe(), cmp.holds(seen))
    return out


def _limits(rule: Rule) -> str:
    parts = [f"count {rule.count}" + (f" within {rule.within.describe()}" if rule.within else "")]
    if rule.persist > 1:
        parts.append(f"persist {rule.persist}")
    if rule.cooldown is not None:
        parts.append(f"cooldown {rule.cooldown.describe()}")
    if rule.max_fires is not None:
        window = f" within {rule.fires_within.describe()}" if rule.fires_within else " in the run"
        parts.append(f"max_fires {rule.max_fires}{window}, then {rule.on_exhausted.describe()}")
    return "; ".join(parts)


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def kept_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The executed steps no later rollback undid: a row is undone when a later tick ran its
    step (or an earlier one) again. In tick order."""
    out: list[dict[str, Any]] = []
    lowest = math.inf
    for m in sorted(rows, key=lambda m: int(m["tick"]), reverse=True):
        if int(m["step"]) < lowest:
            out.append(m)
            lowest = int(m["step"])
    return out[::-1]


def _loss_around(run: RunData, d: dict[str, Any]) -> list[str]:
    """Rank 0's mean loss over the executed steps before the anomaly, and over the kept steps
    (none a rollback later undid) after the action."""
    anomaly = d.get("anomaly") or {}
    rows = run.metrics_of(int(anomaly.get("rank") or 0)) or run.metrics_of(0)
    if not rows:
        return ["no metrics were journaled"]
    tick = anomaly.get("tick")
    if not isinstance(tick, int):
        tick = next((int(m["tick"]) for m in rows if m.get("step") == d.get("step")), 0)
    lead = max(0, int(d.get("apply_at_step") or d.get("step") or 0) - int(d.get("step") or 0))
    before = [v for m in rows if int(m["tick"]) < tick if (v := number(m.get("loss"))) is not None]
    after_rows = [m for m in kept_rows(rows) if int(m["tick"]) > tick + lead]
    after = [v for m in after_rows if (v := number(m.get("loss"))) is not None]
    b, a = _mean(before[-LOSS_WINDOW:]), _mean(after[:LOSS_WINDOW])
    out = [
        f"loss before: {_fmt(b)} (mean of the {min(len(before), LOSS_WINDOW)} executed steps before tick {tick})",
        f"loss after:  {_fmt(a)} (mean of the next {min(len(after), LOSS_WINDOW)} kept steps)",
    ]
    if after_rows:
        first = after_rows[0]
        out.append(
            f"training went on at step {first['step']} (tick {first['tick']}); "
            f"{'no ' if not after else ''}non-finite loss afterwards: "
            f"{sum(1 for v in after if not math.isfinite(v))} of {len(after)} steps"
        )
    else:
        out.append("no step was executed after it")
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


# ------------------------------------------------------------------- rules
def explain_rule(run: RunData, name: str, policy: Policy | None) -> str:
    """Every time the rule matched: fired, held back (and why), or matched without a decision."""
    mine = [d for d in run.decisions if d.get("rule") == name]
    rule = policy.rule(name) if policy is not None else None
    if not mine and rule is None:
        known = sorted({str(d.get("rule")) for d in run.decisions})
        raise LookupError(f"rule {name!r} took no decision in this run; rules that did: {known}")
    lines = [f"rule {name!r}:"]
    if rule is not None:
        lines.append("  " + _limits(rule))
    escalations = [d for d in mine if _is_escalation(d)]
    fired = {
        (d.get("chain") or {}).get("id") or d.get("decision_id")
        for d in mine
        if d.get("outcome") != "suppressed" and not _is_escalation(d)
    }
    held = [d for d in mine if d.get("outcome") == "suppressed"]
    lines.append(
        f"  fired {len(fired)} time(s), held back {len(held)} time(s), "
        f"escalated {len(escalations)} time(s)"
    )
    covered: set[tuple[Any, Any]] = set()
    for d in mine:
        anomaly = d.get("anomaly") or {}
        covered.add((anomaly.get("kind"), anomaly.get("step")))
        verdict = {
            "suppressed": "held back",
            "applied": "fired",
            "failed": "fired, failed",
            "escalated": "fired, failed, escalated",
            "dry_run": "fired (dry run)",
        }.get(str(d.get("outcome")), str(d.get("outcome")))
        if _is_escalation(d):
            verdict = f"escalated ({d.get('outcome')})"
        lines.append(
            f"  step {d.get('step')}: {verdict}: {d.get('action')} — {d.get('reason')}"
            + (f" [{d['detail']}]" if d.get("detail") else "")
        )
    if rule is not None and not rule.escalation_only:
        others = _decisions_by_event(run, name)
        for a in run.anomalies:
            ev = _as_event(a)
            key = (a.get("kind"), a.get("step"))
            if ev is None or key in covered or not rule.matcher(ev):
                continue
            covered.add(key)
            why = (
                f"claimed by rule {others[key]!r} first"
                if key in others
                else "no decision: counted towards count/persist, or absorbed into an earlier occurrence"
            )
            lines.append(
                f"  step {a.get('step')}: matched {a.get('kind')} on rank {a.get('rank')}, {why}"
            )
    return "\n".join(lines)


def _is_escalation(d: dict[str, Any]) -> bool:
    """A decision the engine issued because the rule's max_fires was used up."""
    return "escalating to" in str(d.get("reason", ""))


def _decisions_by_event(run: RunData, rule: str) -> dict[tuple[Any, Any], str]:
    out: dict[tuple[Any, Any], str] = {}
    for d in run.decisions:
        anomaly = d.get("anomaly") or {}
        if d.get("rule") != rule:
            out.setdefault((anomaly.get("kind"), anomaly.get("step")), str(d.get("rule")))
    return out
