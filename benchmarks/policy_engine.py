"""Throughput of the policy engine: events per second through `Engine.decide`.

Three streams over 1024 simulated ranks, each through every bundled policy
(`default`, `conservative`, `llm-pretrain`). Outcomes of carried-out
decisions are recorded as applied, as the supervisor would, so budgets and
inhibitions stay in play.

- rank-local: only events one rank sees on its own (straggler, data_stall,
  gpu_thermal, collective_slow, memory_growth, padding_ratio), 1 to 8 a
  batch on random ranks at one step, as the reports of one step arrive;
- all-rank: each batch is one anomaly every rank reports at one step
  (loss_spike, grad_norm_explosion, scaler_overflow: what data-parallel
  replicas all see);
- mix: the rates a real run has. The clean-run corpus (`clean_runs.py`:
  5 loops x 3 seeds, 1000-1280 steps each) raises no anomaly at all, so
  every event comes from a fault: rank-local events at one per rank per
  1200 steps (`supervisor_load.py`'s default, one per rank per 120 s at 10
  steps/s), and an all-rank fault at the demo chaos scenario's rate (2 in
  300 steps, `examples/chaos/demo.yaml`), with a rank_hang one step in 200.

Then the cost per event as the number of rules grows (10, 50, 200
synthetic rules over all anomaly kinds, with value and severity predicates).

    python benchmarks/policy_engine.py [--steps 2000] [--ranks 1024] [--repeat 5]
    python benchmarks/policy_engine.py --against REV   # before/after: the engine at a git revision

Each measurement is repeated and the median reported. With `--against REV`
the same streams go through the engine of that revision too (its tree,
`git archive REV`, run in a child process of this one), the two measured
in alternation, and the table gives both medians, their ratio and whether
both engines took the same number of decisions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The tree whose engine is measured: this checkout, or (in the child of `--against`) another
# revision's, unpacked by the parent.
sys.path.insert(0, os.environ.get("REMEDY_BENCH_TREE", str(REPO)))

from remedy.policies import (  # noqa: E402 - after the path of the tree measured
    ANOMALY_KINDS,
    AnomalyEvent,
    Engine,
    Policy,
    load_policy,
    load_policy_text,
)

GLOBAL_KINDS = ("loss_spike", "grad_norm_explosion", "scaler_overflow")
LOCAL_KINDS = (
    "straggler", "data_stall", "gpu_thermal", "collective_slow", "memory_growth", "padding_ratio",
)  # fmt: skip
# The mix's rates (see the module docstring).
LOCAL_PER_RANK_STEP = 1 / 1200
GLOBAL_PER_STEP = 2 / 300
HANG_PER_STEP = 1 / 200
Stream = list[list[AnomalyEvent]]


def _local(rng: random.Random, ranks: int, step: int) -> AnomalyEvent:
    kind = rng.choice(LOCAL_KINDS)
    return AnomalyEvent(
        kind, rng.randrange(ranks), step, value=rng.random(), severity="info", ts=step * 0.5
    )


def _all_ranks(rng: random.Random, ranks: int, step: int) -> list[AnomalyEvent]:
    kind = rng.choice(GLOBAL_KINDS)
    value = rng.uniform(5.0, 2000.0)
    return [
        AnomalyEvent(kind, r, step, value=value, threshold=10.0, ts=step * 0.5)
        for r in range(ranks)
    ]


def rank_local_stream(steps: int, ranks: int, seed: int = 0) -> Stream:
    """One batch per step of 1 to 8 rank-local events on random ranks."""
    rng = random.Random(seed)
    return [[_local(rng, ranks, s) for _ in range(rng.randint(1, 8))] for s in range(1, steps + 1)]


def all_rank_stream(steps: int, ranks: int, seed: int = 0) -> Stream:
    """One batch per step: one anomaly reported by every rank."""
    rng = random.Random(seed)
    return [_all_ranks(rng, ranks, s) for s in range(1, steps + 1)]


def mix_stream(steps: int, ranks: int, seed: int = 0) -> Stream:
    """A real run's rates: rare rank-local events, a rarer all-rank fault, the odd hang."""
    rng = random.Random(seed)
    batches: Stream = []
    for step in range(1, steps + 1):
        batch = [
            _local(rng, ranks, step) for _ in range(ranks) if rng.random() < LOCAL_PER_RANK_STEP
        ]
        if rng.random() < GLOBAL_PER_STEP:
            batch.extend(_all_ranks(rng, ranks, step))
        if rng.random() < HANG_PER_STEP:
            batch.append(
                AnomalyEvent("rank_hang", rng.randrange(ranks), step, severity="critical",
                             ts=step * 0.5)
            )  # fmt: skip
        if batch:
            batches.append(batch)
    return batches


STREAMS = {"rank-local": rank_local_stream, "all-rank": all_rank_stream, "mix": mix_stream}


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


POLICIES = ("default", "conservative", "llm-pretrain")


def one_round(steps: int, ranks: int) -> dict[str, dict[str, list[float]]]:
    """Each stream through each bundled policy once: {stream: {policy: [events/s, decisions]}}."""
    out: dict[str, dict[str, list[float]]] = {}
    for stream, make in STREAMS.items():
        batches = make(steps, ranks)
        for name in POLICIES:
            seconds, events, decisions = run_once(load_policy(name), batches)
            out.setdefault(stream, {})[name] = [events / seconds, decisions]
    return out


def against(rev: str, args: argparse.Namespace) -> int:
    """Before/after: this checkout's engine and `rev`'s, on the same streams, in alternation."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True
        ).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="tar")
        env = {**os.environ, "REMEDY_BENCH_TREE": tmp}
        child = [sys.executable, __file__, "--one-round", "--steps", str(args.steps),
                 "--ranks", str(args.ranks)]  # fmt: skip
        rounds: dict[str, list[dict[str, dict[str, list[float]]]]] = {"new": [], "old": []}
        for _ in range(args.repeat):
            rounds["new"].append(one_round(args.steps, args.ranks))
            done = subprocess.run(child, capture_output=True, text=True, check=True, env=env)
            rounds["old"].append(json.loads(done.stdout.splitlines()[-1]))
    print(f"{args.ranks} ranks, {args.steps} steps; {rev} (before) and this checkout (after), "
          f"alternated, medians of {args.repeat}")  # fmt: skip
    print(f"{'stream':<12}{'policy':<14}{'before ev/s':>13}{'after ev/s':>13}{'ratio':>8}  same")
    for stream in STREAMS:
        for name in POLICIES:
            before = statistics.median(r[stream][name][0] for r in rounds["old"])
            after = statistics.median(r[stream][name][0] for r in rounds["new"])
            same = rounds["old"][0][stream][name][1] == rounds["new"][0][stream][name][1]
            print(f"{stream:<12}{name:<14}{before:>13,.0f}{after:>13,.0f}{after / before:>8.2f}  "
                  f"{'yes' if same else 'NO'}")  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--rules", action="store_true", help="also the cost per event vs rule count"
    )
    parser.add_argument("--against", metavar="REV", help="also measure the engine at REV")
    parser.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)
    # Added by hand, not through benchmarks._smoke: the child of --against runs with another
    # revision's tree first on the path, where that module may not exist.
    parser.add_argument(
        "--check-imports",
        action="store_true",
        help="import everything this benchmark needs, parse the arguments, and exit (a smoke run)",
    )
    args = parser.parse_args()
    if args.check_imports:
        from benchmarks._smoke import check_imports  # noqa: PLC0415 - see --check-imports above

        check_imports()
        return 0
    if args.one_round:  # the child of --against: one round, as JSON
        print(json.dumps(one_round(args.steps, args.ranks)))
        return 0
    if args.against:
        return against(args.against, args)

    print(f"{args.ranks} ranks, {args.steps} steps, median of {args.repeat}")
    print(
        f"{'stream':<12}{'policy':<14}{'events':>9}{'decisions':>11}{'events/s':>13}{'ns/event':>10}"
    )
    local_rates = {}
    for stream, make in STREAMS.items():
        batches = make(args.steps, args.ranks)
        for name in ("default", "conservative", "llm-pretrain"):
            rate, events, decisions = median_rate(load_policy(name), batches, args.repeat)
            if stream == "rank-local":
                local_rates[name] = rate
            print(
                f"{stream:<12}{name:<14}{events:>9}{decisions:>11}{rate:>13,.0f}{1e9 / rate:>10.0f}"
            )
    if args.rules:
        batches = mix_stream(args.steps, args.ranks)
        for n_rules in (10, 50, 200):
            rate_n, events_n, decisions_n = median_rate(
                synthetic_policy(n_rules), batches, args.repeat
            )
            name = f"{n_rules} rules"
            print(
                f"{'mix':<12}{name:<14}{events_n:>9}{decisions_n:>11}{rate_n:>13,.0f}{1e9 / rate_n:>10.0f}"
            )
    goal = 1_000_000
    worst = min(local_rates.values())
    print(f"goal >= {goal:,} rank-local events/s with every bundled policy: "
          f"{'met' if worst >= goal else 'NOT met'} (lowest {worst:,.0f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
