"""The engine: anomaly events in, decisions out.

`Engine.decide` takes one batch of events (what the supervisor received
together, from any ranks and steps), slices it by tick, and runs the rules
in file order on each slice. A rule takes the events its `when` matches,
groups them (`group_by`, by default kind and step: one decision for the
same anomaly on many ranks), counts each group as one occurrence, and fires
when its `count`/`within`/`persist` condition holds. The first rule that
matches a group claims it, unless it says `continue: true`. Firing passes
through the gates in this order: cooldown (with back-off), `max_fires`
(escalating by `on_exhausted`), the disruption budget; a gate that stops a
match records at most one suppressed decision per suppression period. The
counters behind these gates are kept per state key (`_rulestate.state_fields`:
per kind with `group_by: [kind]`, per rule when the rule groups by step).
A chain is issued whole; a failed step ends it unless it says
`on_failure: next` (see `Decision.continue_on_failure`).
An incident that comes back at the same step after a rewind a rule chose
for it is answered by the escalation ladder (`_ladder`), not by the rule
again: the rule's counters no longer see it, and the ladder's rungs end in
a stop, so no restart loop runs for ever.

Everything is deterministic: the same stream gives the same decisions and
the same ids, which is what makes the journal replayable and the property
tests possible.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from remedy.policies._budget import Budget
from remedy.policies._engine_state import dump_state, load_state
from remedy.policies._events import AnomalyEvent, Decision
from remedy.policies._ladder import Ladder, Move, rung_steps
from remedy.policies._occurrence import Occurrence, Pending
from remedy.policies._reasons import (
    action_phrase,
    chain_text,
    condition,
    fires_text,
    fires_window,
    seen,
    sentence,
)
from remedy.policies._rules import Escalation, Policy, Rule, Step, thaw
from remedy.policies._rulestate import GroupKey, KeyState, RuleState
from remedy.policies._vocab import DISRUPTIVE_ACTIONS, severity_rank
from remedy.policies.exceptions import OutcomeError

_MAX_PENDING = 4096
_MAX_ESCALATION_DEPTH = 8


class Engine:
    """Runs a `Policy` over anomaly events; see the module docstring."""

    def __init__(
        self, policy: Policy, *, run_id: str = "run", dry_run: bool = False, incarnation: int = 1
    ) -> None:
        self.run_id = run_id
        # The supervisor's incarnation (1, then one more per restart) is part of every
        # decision id after the first: ids stay unique across restarts even if the
        # restored sequence number were behind (see `decision_id`).
        self.incarnation = incarnation
        self._dry_run_flag = dry_run
        self._lock = threading.RLock()
        self._seq = 0
        self._tick = 0
        self._ts = 0.0
        self._budget = Budget()
        # Matches held back behind an in-flight disruptive decision, by its id: judged
        # again once it is applied (`record_outcome`), so a spike found while a rank
        # restart is in flight is still rolled back. A held restart_rank is not kept: a
        # hang or a death is reported again while it lasts, and a restart decided from a
        # stale report could replace a rank that the applied action already replaced.
        self._held: dict[str, list[tuple[Rule, Occurrence, str | None, int]]] = {}
        self._pending: OrderedDict[str, Pending] = OrderedDict()
        self._states: dict[str, RuleState] = {}
        # Incidents remedied by a rewind, and their rung (`_ladder`): a fault that comes back
        # at the same step climbs instead of looping.
        self._ladder = Ladder()
        self._install(policy)

    # -- configuration ---------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        """The policy in force."""
        return self._policy

    @property
    def dry_run(self) -> bool:
        """True when decisions are journaled but not carried out."""
        return self._dry_run_flag or self._policy.dry_run

    def reload(self, policy: Policy) -> None:
        """Swap in a new policy atomically; counters and cooldowns survive for kept rule names."""
        with self._lock:
            self._install(policy)

    def _install(self, policy: Policy) -> None:
        states: dict[str, RuleState] = {}
        for rule in policy.rules:
            state = self._states.get(rule.name)
            if state is None:
                state = RuleState(rule)
            else:
                state.adapt(rule)
            states[rule.name] = state
        index: dict[str, list[int]] = {}
        wildcard = [i for i, r in enumerate(policy.rules) if r.matcher.kinds is None]
        for i, rule in enumerate(policy.rules):
            for kind in rule.matcher.kinds or ():
                index.setdefault(kind, []).append(i)
        self._index = {k: sorted({*v, *wildcard}) for k, v in index.items()}
        self._wildcard = wildcard
        self._keys: list[Callable[[AnomalyEvent], GroupKey]] = [
            operator.attrgetter(*r.group_by) for r in policy.rules
        ]
        # Whether a rule's groups each hold one kind (it groups by kind), so that
        # removing a claimed group needs no look at its members' kinds.
        self._by_kind = ["kind" in r.group_by for r in policy.rules]
        self._policy, self._states = policy, states

    # -- deciding --------------------------------------------------------------------

    def decide(self, events: Sequence[AnomalyEvent], *, now: float | None = None) -> list[Decision]:
        """Decisions for one batch of events, in order (see the module docstring)."""
        with self._lock:
            out: list[Decision] = []
            if not events:
                return out
            # One pass: the batch's ticks and kinds. Nearly every batch is one tick (one
            # rank's report, or one step of every rank), which then needs no slicing.
            first = events[0].tick
            by_kind: dict[str, list[AnomalyEvent]] = {}
            ts = events[0].ts
            for event in events:
                if event.tick != first:
                    break
                if event.ts > ts:
                    ts = event.ts
                bucket = by_kind.get(event.kind)
                if bucket is None:
                    by_kind[event.kind] = [event]
                else:
                    bucket.append(event)
            else:
                self._run_slice(by_kind, first, now if now is not None else ts, out)
                return out
            slices: dict[int, list[AnomalyEvent]] = {}
            for event in events:
                slices.setdefault(event.tick, []).append(event)
            for tick in sorted(slices):
                part = slices[tick]
                by_kind = {}
                for event in part:
                    by_kind.setdefault(event.kind, []).append(event)
                self._run_slice(
                    by_kind, tick, now if now is not None else max(e.ts for e in part), out
                )
            return out

    def _run_slice(
        self, pending: dict[str, list[AnomalyEvent]], tick: int, ts: float, out: list[Decision]
    ) -> None:
        """Run the rules over one tick's events, `pending` by kind (claimed ones are removed)."""
        if tick > self._tick:
            self._tick = tick
        if ts > self._ts:
            self._ts = ts
        index, wildcard = self._index, self._wildcard
        if len(pending) == 1:
            candidates: Sequence[int] = index.get(next(iter(pending)), wildcard)
        else:
            found: set[int] = set()
            for kind in pending:
                found.update(index.get(kind, wildcard))
            candidates = sorted(found)
        rules = self._policy.rules
        for ri in candidates:
            if not pending:
                return
            rule = rules[ri]
            kinds = rule.matcher.kinds
            key_of = self._keys[ri]
            check = None if rule.matcher.trivial else rule.matcher
            by_kind = self._by_kind[ri]
            groups: dict[GroupKey, list[AnomalyEvent]] = {}
            for kind, bucket in pending.items():
                if kinds is not None and kind not in kinds:
                    continue
                for event in bucket:
                    if check is None or check(event):
                        key = key_of(event)
                        members = groups.get(key)
                        if members is None:
                            groups[key] = [event]
                        else:
                            members.append(event)
            for key, members in groups.items():
                if self._evaluate(rule, key, members, tick, ts, out) and not rule.cont:
                    _remove(pending, members, one_kind=by_kind)

    def _evaluate(
        self,
        rule: Rule,
        key: GroupKey,
        members: list[AnomalyEvent],
        tick: int,
        ts: float,
        out: list[Decision],
    ) -> bool:
        """Judge one group for one rule; return True when the rule claims it."""
        state = self._states[rule.name]
        ranks = {members[0].rank} if len(members) == 1 else {e.rank for e in members}
        late = state.seen_group(key, ranks)
        if late is not None:
            return late
        occ = Occurrence(_representative(members), tuple(sorted(ranks)), tick, ts)
        move = self._ladder.sighting(occ.event, tick=tick)
        if move is not None and (move.rung > 0 or not move.act):
            # An incident a rewind did not cure, past its first rung: the ladder answers it.
            state.remember(key, ranks, True)
            self._ladder_step(move, occ, out)
            return True
        if move is not None:
            # Rung 0 is the rule's own remedy, under its own gates (a cooldown may hold it
            # back); the decision says which sighting of the incident it answers.
            occ = Occurrence(_with_ladder(occ.event, move), occ.ranks, tick, ts)
        counters = state.for_event(occ.event)
        inhibition = self._budget.inhibition(occ.event.kind, tick, self._policy.inhibit)
        if inhibition is not None:
            state.remember(key, ranks, True)
            marker = f"inhibit:{inhibition.period}"
            if counters.marker == marker:
                return True  # suppressed already this period: no sentence to build
            entry = inhibition.entry
            after = f" and for {entry.warmup_steps} steps after" if entry.warmup_steps else ""
            why = (
                f" but {occ.event.kind} is inhibited while {entry.while_action} is in progress"
                f"{after} ({inhibition.period}); not acting"
            )
            self._suppress(rule, counters, occ, marker, why, out)
            return True
        met = counters.observe(rule, tick, ts)
        # A rule claims what it matches when its condition holds, and while it cools down
        # after firing (so the aftermath does not fall through to later rules); while it is
        # still counting towards `count`/`persist`, the events go on to later rules.
        claimed = met or counters.cooldown_left(tick, ts) > 0
        state.remember(key, ranks, claimed)
        if met:
            self._gate(rule, occ, out, prefix=None, depth=0, state=counters)
        return claimed

    def _gate(
        self,
        rule: Rule,
        occ: Occurrence,
        out: list[Decision],
        *,
        prefix: str | None,
        depth: int,
        state: KeyState | None = None,
    ) -> None:
        """Pass a match through cooldown, max_fires and the budget; fire or suppress.

        `state`: the rule's counters for the event, when the caller has them already.
        A suppression already recorded for its period returns before its sentence is
        built: under a cooldown that is every later match, the common case.
        """
        rule_state = self._states[rule.name]
        if state is None:
            state = rule_state.for_event(occ.event)
        tick, ts = occ.tick, occ.ts
        left = state.cooldown_left(tick, ts)
        if left > 0 and state.last_fire is not None and state.cooldown is not None:
            marker = f"cooldown:{state.last_fire[0]}"
            if state.marker == marker:
                return
            amount = f"{int(left)} more steps" if state.cooldown.steps else f"{left:g}s more"
            why = (
                f" but it is cooling down{rule_state.describe_key(occ.event)} for {amount} "
                f"(cooldown {state.cooldown.describe()} after firing at step "
                f"{state.last_fire[2]}); not repeating {rule.steps[0].action}"
            )
            self._suppress(rule, state, occ, marker, why, out)
            return
        if state.exhausted(rule, tick, ts):
            period = state.exhaustion_period()
            # A rule target is the next rung of a ladder: every later match of this rule
            # climbs to it, bounded by that rule's own cooldown and max_fires. Abort and
            # notify go out once per exhaustion, and so does a rung reached by escalation
            # (a cycle of exhausted rules ends there).
            ladder = rule.on_exhausted.kind == "rule" and depth == 0
            if state.escalated == period and not ladder:
                if state.marker == f"exhausted:{period}":
                    return
                why = (
                    f" but it fired max_fires={rule.max_fires} times {fires_window(rule)} "
                    "and has already escalated; not acting"
                )
                self._suppress(rule, state, occ, f"exhausted:{period}", why, out)
                return
            state.escalated = period
            head = (
                f"{seen(occ.event, occ.ranks)}: rule {rule.name!r} fired "
                f"max_fires={rule.max_fires} times {fires_window(rule)}; "
                f"escalating to {rule.on_exhausted.describe()}"
            )
            self._escalate(rule.name, rule.on_exhausted, occ, head, out, depth)
            return
        busy = self._budget.busy()
        if busy is not None and rule.disruptive and not self.dry_run:
            if state.marker == f"budget:{busy[0]}":
                return
            why = (
                f" but {busy[1]} ({busy[0]}) is still in flight and only one disruptive "
                f"action runs at a time; holding back {rule.steps[0].action}"
            )
            if rule.steps[0].action != "restart_rank":
                self._held.setdefault(busy[0], []).append((rule, occ, prefix, depth))
            self._suppress(rule, state, occ, f"budget:{busy[0]}", why, out)
            return
        number = state.record_fire(rule, tick, ts, occ.event.step)
        if prefix is None:
            head = f"{seen(occ.event, occ.ranks)} matched rule {rule.name!r} {condition(rule)}; "
        else:
            head = f"{prefix}: "
        tail = fires_text(rule, number)
        chain = self._emit(
            rule.name,
            rule.steps,
            occ,
            lambda i: sentence(head, chain_text(rule, i, rule.steps), tail),
            out,
        )
        if not self.dry_run:
            self._ladder.remedied(
                occ.event, tick=tick, rule=rule.name, chain=chain, steps=rule.steps
            )

    def _ladder_step(self, move: Move, occ: Occurrence, out: list[Decision]) -> None:
        """Apply the rung the ladder chose for an incident that came back (`_ladder`)."""
        if not move.act:
            return
        inc = move.incident
        own = self._policy.rule(inc.rule)
        steps = rung_steps(inc, move.rung, own.steps if own is not None else None)
        occ = Occurrence(_with_ladder(occ.event, move), occ.ranks, occ.tick, occ.ts)
        head = f"{seen(occ.event, occ.ranks)}: escalation ladder for rule {inc.rule!r}: {move.why}"
        busy = self._budget.busy()
        if busy is not None and any(s.disruptive for s in steps) and not self.dry_run:
            why = f"; but {busy[1]} ({busy[0]}) is still in flight; not acting"
            out.append(
                self._make(inc.rule, steps[0], occ, sentence(head, why), "", 0, 1, suppressed=True)
            )
            return

        def reason(i: int) -> str:
            phrase = action_phrase(steps[i].action, steps[i].params)
            where = f"step {i + 1} of {len(steps)}: " if len(steps) > 1 else ""
            return sentence(head, f"; {where}{phrase}")

        self._ladder.issued(inc, self._emit(inc.rule, steps, occ, reason, out))

    def _escalate(
        self,
        origin: str,
        target: Escalation,
        occ: Occurrence,
        head: str,
        out: list[Decision],
        depth: int,
    ) -> None:
        """Carry out an `on_exhausted` / `on_failure` target: abort, notify, or another rule."""
        rule = self._policy.rule(target.rule) if target.rule is not None else None
        if target.kind == "rule" and rule is not None and depth < _MAX_ESCALATION_DEPTH:
            self._gate(rule, occ, out, prefix=head, depth=depth + 1)
            return
        action = "notify" if target.kind == "notify" else "abort"
        text = sentence(head)
        if target.kind == "rule":
            text = sentence(head, " (rule unavailable or escalation too deep); aborting")
        params = {"message": text} if action == "notify" else {"reason": text}
        step = Step(action, params)
        self._emit(origin, (step,), occ, lambda _i: text, out)

    def _suppress(
        self,
        rule: Rule,
        state: KeyState,
        occ: Occurrence,
        marker: str,
        why: str,
        out: list[Decision],
    ) -> None:
        """Record one suppressed decision per rule and state key per suppression period."""
        if state.marker == marker:
            return
        state.marker = marker
        reason = sentence(f"{seen(occ.event, occ.ranks)} matched rule {rule.name!r}", why)
        step = rule.steps[0]
        decision = self._make(rule.name, step, occ, reason, "", 0, 1, suppressed=True)
        out.append(decision)

    # -- emitting --------------------------------------------------------------------

    def _emit(
        self,
        rule_name: str,
        steps: Sequence[Step],
        occ: Occurrence,
        reason: Callable[[int], str],
        out: list[Decision],
    ) -> str:
        """Issue a chain's steps as decisions, tracking the ones carried out; the chain's id."""
        chain_id = ""
        for i, step in enumerate(steps):
            decision = self._make(rule_name, step, occ, reason(i), chain_id, i, len(steps))
            chain_id = decision.chain_id
            out.append(decision)
            if decision.dry_run:
                continue
            self._track(decision, step, occ)
        return chain_id

    def _make(
        self,
        rule_name: str,
        step: Step,
        occ: Occurrence,
        reason: str,
        chain_id: str,
        index: int,
        length: int,
        *,
        suppressed: bool = False,
    ) -> Decision:
        self._seq += 1
        decision_id = self.decision_id(self._seq)
        return Decision(
            decision_id=decision_id,
            step=occ.event.step,
            ranks=occ.ranks,
            rule=rule_name,
            anomaly=occ.event,
            action=step.action,
            params=thaw(step.params),
            reason=reason,
            chain_id=chain_id or decision_id,
            chain_index=index,
            chain_length=length,
            dry_run=self.dry_run,
            suppressed=suppressed,
            disruptive=step.action in DISRUPTIVE_ACTIONS,
            continue_on_failure=not suppressed
            and step.on_failure is not None
            and step.on_failure.kind == "next",
        )

    def _track(self, decision: Decision, step: Step, occ: Occurrence) -> None:
        """Remember an issued decision until its outcome (budget, inhibit, on_failure)."""
        inhibiting = any(e.while_action == step.action for e in self._policy.inhibit)
        if decision.disruptive or inhibiting:
            self._budget.take(
                decision.decision_id, step.action, occ.tick, disruptive=decision.disruptive
            )
        self._pending[decision.decision_id] = Pending(
            decision.rule,
            decision.chain_id,
            decision.chain_index,
            decision.chain_length,
            step.action,
            occ,
            step.on_failure,
        )
        while len(self._pending) > _MAX_PENDING:
            oldest = next(iter(self._pending))
            if oldest in self._budget.in_flight:
                self._pending.move_to_end(oldest)
                break
            del self._pending[oldest]

    def decision_id(self, seq: int) -> str:
        """The id of decision number `seq`: `RUN-dNNNNN`, `RUN-sK-dNNNNN` from supervisor incarnation K > 1."""
        if self.incarnation > 1:
            return f"{self.run_id}-s{self.incarnation}-d{seq:05d}"
        return f"{self.run_id}-d{seq:05d}"

    @property
    def seq(self) -> int:
        """Decisions issued so far (the number in the last id)."""
        return self._seq

    def advance_seq(self, seq: int) -> None:
        """Never issue a number at or below `seq` (a journaled decision newer than the restored state)."""
        with self._lock:
            self._seq = max(self._seq, seq)

    # -- outcomes --------------------------------------------------------------------

    @property
    def holding_back(self) -> bool:
        """Whether a match is held back behind an in-flight disruptive decision: a decision
        still to be taken once that one's outcome comes."""
        return any(self._held.values())

    def record_outcome(
        self, decision_id: str, outcome: str, *, tick: int, detail: str = ""
    ) -> list[Decision]:
        """Learn how a decision went; free the budget, start warm-ups, return follow-ups."""
        if outcome not in ("applied", "failed"):
            raise OutcomeError(f"outcome must be 'applied' or 'failed', got {outcome!r}")
        with self._lock:
            self._tick = max(self._tick, tick)
            pending = self._pending.pop(decision_id, None)
            self._budget.release(decision_id)
            if pending is None:
                return []
            climb = self._ladder.resolved(pending.chain_id, pending.action, outcome, detail)
            held = self._held.pop(decision_id, [])
            if outcome == "applied":
                if any(e.while_action == pending.action for e in self._policy.inhibit):
                    self._budget.mark_applied(pending.action, tick, decision_id)
                return self._release_held(held, pending.action, decision_id, tick)
            if pending.on_failure is not None and pending.on_failure.kind == "next":
                # `on_failure: next`: the later steps were issued with this one and go
                # ahead (the decision says so: `continue_on_failure`); nothing to add.
                return []
            # A failed step ends its chain: the dispatcher drops the later steps, so they
            # will get no outcome; stop waiting for them (and free the budget they hold).
            dropped = [
                other_id
                for other_id, other in self._pending.items()
                if other.chain_id == pending.chain_id and other.chain_index > pending.chain_index
            ]
            for other_id in dropped:
                del self._pending[other_id]
                self._budget.release(other_id)
            if climb is not None:  # a rung of the ladder failed: the next one, at once
                out: list[Decision] = []
                occ = pending.occurrence
                self._ladder_step(climb, Occurrence(occ.event, occ.ranks, tick, self._ts), out)
                return out
            return self._follow_up(decision_id, pending, tick, detail)

    def _release_held(
        self,
        held: list[tuple[Rule, Occurrence, str | None, int]],
        action: str,
        decision_id: str,
        tick: int,
    ) -> list[Decision]:
        """The matches held back behind `decision_id`, judged again now that it is applied
        (cooldowns, max_fires and the budget as for any match)."""
        out: list[Decision] = []
        for rule, occ, prefix, depth in held:
            head = prefix or (
                f"{seen(occ.event, occ.ranks)} matched rule {rule.name!r} {condition(rule)} "
                f"and was held back until {action} ({decision_id}) was applied"
            )
            again = Occurrence(occ.event, occ.ranks, tick, self._ts)
            self._gate(rule, again, out, prefix=head, depth=depth)
        return out

    def _follow_up(
        self, decision_id: str, pending: Pending, tick: int, detail: str
    ) -> list[Decision]:
        """The escalation a failed step's `on_failure` asks for (abort, notify or a rule)."""
        out: list[Decision] = []
        target = pending.on_failure
        if target is None:
            return out
        occ = Occurrence(pending.occurrence.event, pending.occurrence.ranks, tick, self._ts)
        failed = f"{pending.action} ({decision_id}) failed" + (f": {detail}" if detail else "")
        head = f"{failed}; rule {pending.rule!r} says on_failure: {target.describe()}"
        self._escalate(pending.rule, target, occ, head, out, depth=0)
        return out

    # -- persistence -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a restarted supervisor needs to carry on: JSON-able."""
        with self._lock:
            return dump_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters, cooldowns, budget and in-flight decisions from `state_dict`."""
        with self._lock:
            load_state(self, state)


def _with_ladder(event: AnomalyEvent, move: Move) -> AnomalyEvent:
    """`event` carrying the ladder's record of its incident (`details["ladder"]`)."""
    return dataclasses.replace(event, details={**event.details, "ladder": move.details()})


def _representative(members: list[AnomalyEvent]) -> AnomalyEvent:
    """The first of the most severe members (severities are compared only where they differ)."""
    best = members[0]
    if len(members) > 1:
        sev = best.severity
        rank: int | None = None
        for event in members:
            s = event.severity
            if s != sev:
                if rank is None:
                    rank = severity_rank(sev)
                r = severity_rank(s)
                if r > rank:
                    best, sev, rank = event, s, r
    return best


def _remove(
    pending: dict[str, list[AnomalyEvent]], members: list[AnomalyEvent], *, one_kind: bool
) -> None:
    kind = members[0].kind
    if (one_kind or all(m.kind == kind for m in members)) and len(pending.get(kind, ())) == len(
        members
    ):
        del pending[kind]
        return
    gone = {id(m) for m in members}
    for k in {m.kind for m in members}:
        left = [e for e in pending.get(k, ()) if id(e) not in gone]
        if left:
            pending[k] = left
        else:
            pending.pop(k, None)
