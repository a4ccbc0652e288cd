"""Throughput of the policy engine: events per second through `Engine.decide`.

Runs the bundled llm-pretrain policy over a synthetic 1024-rank stream with
a realistic mix: most events arrive as per-step batches in which every rank
reports the same anomaly (a loss spike, a gradient-norm spike, a scaler
overflow seen by all data-parallel replicas), plus a trickle of rank-local
events (stragglers, slow data, thermal throttling) and the odd hang.
Outcomes of carried-out decisions are recorded as applied, as the
supervisor would, so budgets and inhibitions stay in play.

Then measures the cost per event as the number of rules grows (10, 50,
200 synthetic rules spread over all anomaly kinds, with value and severity
predicates so rules do real work).

    python benchmarks/policy_engine.py [--steps 2000] [--ranks 1024] [--repeat 5]

Each measurement is repeated and the median reported. Runs on one core in
well under a minute.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remedy.policies import (
    ANOMALY_KINDS,
    AnomalyEvent,
    Engine,
    Policy,
    load_policy,
    load_policy_text,
)

GLOBAL_KINDS = ("loss_spike", "grad_norm_explosion", "scaler_overflow", "nonfinite_loss")
LOCAL_KINDS = ("straggler", "data_stall", "gpu_thermal", "collective_slow", "memory_growth")


def make_stream(steps: int, ranks: int, seed: int = 0) -> list[list[AnomalyEvent]]:
    """One batch per step; most events come in all-rank groups."""
    rng = random.Random(seed)
    batches: list[list[AnomalyEvent]] = []
    for step in range(1, steps + 1):
        batch: list[AnomalyEvent] = []
        ts = step * 0.5
        if rng.random() < 0.3:
            kind = rng.choice(GLOBAL_KINDS[:3]) if rng.random() < 0.98 else "nonfinite_loss"
            value = rng.uniform(5.0, 2000.0)
            batch.extend(
                AnomalyEvent(kind, r, step, value=value, threshold=10.0, ts=ts)
                for r in range(ranks)
            )
        for _ in range(rng.randint(0, 8)):
            kind = rng.choice(LOCAL_KINDS)
            batch.append(
                AnomalyEvent(
                    kind, rng.randrange(ranks), step, value=rng.random(), severity="info", ts=ts
                )
            )
        if rng.random() < 0.005:
            batch.append(
                AnomalyEvent("rank_hang", rng.randrange(ranks), step, severity="critical", ts=ts)
            )
        if batch:
            batches.append(batch)
    return batches


def run_once(policy: Policy, batches: list[list[AnomalyEvent]]) -> tuple[float, int, int]:
    """Seconds to decide every batch (outcomes included), events seen, decisions made."""
    engine = Engine(policy, run_id="bench")
    events = decisions = 0
    start = time.perf_counter()
    for batch in batches:
        events += len(batch)
        out = engine.decide(batch)
        decisions += len(out)
        tick = batch[0].tick
        for d in out:
            if not d.suppressed:
                engine.record_outcome(d.decision_id, "applied", tick=tick)
    return time.perf_counter() - start, events, decisions


def synthetic_policy(n_rules: int, seed: int = 1) -> Policy:
    """`n_rules` rules over every anomaly kind, with value/severity predicates and limits."""
    rng = random.Random(seed)
    lines = ["version: 1", "rules:"]
    for i in range(n_rules):
        kind = ANOMALY_KINDS[i % len(ANOMALY_KINDS)]
        lines.append(f"  - name: rule-{i}")
        threshold = rng.choice([1, 50, 500, 1500])
        lines.append(f'    when: [{{anomaly: {kind}}}, {{value: "> {threshold}"}}]')
        lines.append("    do: [notify]")
        lines.append(f"    cooldown_steps: {rng.randint(1, 50)}")
        if rng.random() < 0.5:
            lines.append(f"    max_fires: {rng.randint(5, 50)}")
            lines.append("    fires_within: 1000")
            lines.append("    on_exhausted: notify")
    return load_policy_text("\n".join(lines) + "\n", f"<{n_rules} rules>")


def median_rate(
    policy: Policy, batches: list[list[AnomalyEvent]], repeat: int
) -> tuple[float, int, int]:
    """Median events/s over `repeat` runs, with event and decision counts."""
    rates = []
    events = decisions = 0
    for _ in range(repeat):
        seconds, events, decisions = run_once(policy, batches)
        rates.append(events / seconds)
    return statistics.median(rates), events, decisions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    batches = make_stream(args.steps, args.ranks)
    policy = load_policy("llm-pretrain")
    rate, events, decisions = median_rate(policy, batches, args.repeat)
    print(f"llm-pretrain.yaml, {args.ranks} ranks, {args.steps} steps, {len(batches)} batches")
    print(f"{'policy':<22}{'events':>10}{'decisions':>11}{'events/s (median)':>20}{'ns/event':>10}")
    print(f"{'llm-pretrain':<22}{events:>10}{decisions:>11}{rate:>20,.0f}{1e9 / rate:>10.0f}")
    for n_rules in (10, 50, 200):
        rate_n, events_n, decisions_n = median_rate(synthetic_policy(n_rules), batches, args.repeat)
        name = f"synthetic {n_rules} rules"
        print(f"{name:<22}{events_n:>10}{decisions_n:>11}{rate_n:>20,.0f}{1e9 / rate_n:>10.0f}")
    goal = 100_000
    print(f"goal >= {goal:,} events/s: {'met' if rate >= goal else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
