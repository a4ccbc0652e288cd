"""What telling a chip from the data costs: a replica check per step, a replay per anomaly.

N gloo ranks in fresh processes train the example GPT (examples/pretrain_gpt.py
defaults: 4 layers, width 128, batches of 16x64 tokens, 0.8M parameters) under
DDP, each through a Guard with the default detectors.

Replica check (`workers.replicas`): after the warm-up, steps and checks
alternate (`ReplicaCheck.check`: the bit sums of every parameter and optimizer
state element, then one all-gather of two int64s); printed per world size are
the median step, the median check, the check as a fraction of a step, what the
check adds at the default period (`DEFAULT_EVERY`) and the period that keeps it
under 0.1% of the step.

Replay (`workers.replay`): a chaos `bitflip` hits a gradient of the last rank
at each of `--replays` steps; the rank that flags the step keeps its pre-update
state, and a `replay_step` command applied on every rank at the next boundary
re-runs the step (all-reduce included) and the suspect's batch on a witness.
Printed: the median replay time (`replay_s`, restore and both re-runs and the
gathers) and as steps; and the time the flagged step took to keep its state
(the one full copy a replay needs), against a step.

Flag hold (`workers.flag_hold`, on under a policy that replays): each step
launches one 1-element all-reduce beside its optimizer step, read at the next
boundary. Blocks of `--block` steps with it on and off alternate in the same
ranks; printed: the median iteration (step plus boundary) of each, and the
ratio.

    python benchmarks/replay_costs.py [--worlds 2,4] [--pairs 30] [--replays 5] [--block 10]

Timings on a shared machine are noisy: the load average is printed with each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._smoke import add_check_imports, check_imports  # noqa: E402
from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss  # noqa: E402
from remedy.protocol.commands import Command  # noqa: E402
from remedy.rank import Guard, GuardConfig  # noqa: E402
from remedy.rank.chaos.faults import parse_chaos  # noqa: E402
from remedy.rank.group.replicas import DEFAULT_EVERY, ReplicaCheck  # noqa: E402
from remedy.rank.link.context import WorkerContext  # noqa: E402
from tests.workers.fsdp_ranks import spawn_ranks  # noqa: E402

CFG = GPTConfig()  # the example's defaults
QUIET = "version: 1\nrules:\n  - name: quiet\n    when: {anomaly: gpu_ecc}\n    do: [notify]\n"
WARMUP = 25  # steps before anything is timed (the loss-spike detector's history, DDP buckets)


def _guard(rank: int, world: int, faults: list[dict[str, Any]], policy: str, steps: int) -> Guard:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(GPT(CFG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    corpus = SyntheticCorpus(block_size=CFG.block_size, batch_size=16, seed=0)
    ctx = WorkerContext(rank=rank, world_size=world, faults=parse_chaos({"faults": faults}))
    return Guard(
        model, optimizer, loss_fn=lm_loss, data=lambda i: corpus.batch(i * world + rank),
        max_steps=steps, context=ctx,
        config=GuardConfig(policy=policy, replica_check_every=0, replay_wait_s=0.0),
    )  # fmt: skip


def _checks(rank: int, world: int, pairs: int, policy: str) -> dict[str, Any]:
    guard = _guard(rank, world, [], policy, WARMUP + pairs)
    check = ReplicaCheck(1)
    steps, checks = [], []
    for batch in guard:
        t0 = time.perf_counter()
        guard.step(batch)
        t1 = time.perf_counter()
        if guard.step_count > WARMUP:
            assert check.check(guard) is None, "healthy replicas must agree"
            steps.append(t1 - t0)
            checks.append(time.perf_counter() - t1)
    guard.close()
    return {"steps": steps, "checks": checks}


def _replays(rank: int, world: int, count: int, policy: str) -> dict[str, Any]:
    at = [WARMUP + 5 * i for i in range(count)]
    faults = [{"kind": "bitflip", "at_step": s, "rank": world - 1, "target": "grad"} for s in at]
    guard = _guard(rank, world, faults, policy, at[-1] + 3)
    steps, keeps, replays, phases = [], [], [], []
    asked: set[int] = set()
    for batch in guard:
        kept_before = len(guard.replays.kept)
        t0 = time.perf_counter()
        result = guard.step(batch)
        took = time.perf_counter() - t0
        if len(guard.replays.kept) > kept_before or result.step in at:
            keeps.append(took)  # the flagged step, which copied its pre-update state
        elif result.step > WARMUP:
            steps.append(took)
        if result.step in at and result.step not in asked:
            asked.add(result.step)
            seq = len(asked) - 1  # the same on every rank; replays apply in lock step
            guard.submit(Command(f"r{seq}", "replay_step", {}, result.step + 1, result.step,
                                 guard.tick, seq=0))  # fmt: skip
    guard.close()
    for outcome in guard.history:
        verdict = outcome.result.get("verdict")
        if verdict is not None:
            assert verdict["kind"] == "replay_transient", verdict["reason"]
            replays.append(float(verdict["replay_s"]))
            phases.append(verdict["phases_s"])
    return {"steps": steps, "keeps": keeps, "replays": replays, "phases": phases}


def _flag_cost(rank: int, world: int, blocks: int, block: int, policy: str) -> dict[str, Any]:
    guard = _guard(rank, world, [], policy, WARMUP + 2 * blocks * block)
    times: dict[bool, list[float]] = {True: [], False: []}
    last: tuple[float, bool] | None = None
    for batch in guard:
        now = time.perf_counter()
        if last is not None and guard.step_count > WARMUP + 1:
            times[last[1]].append(now - last[0])  # the previous step and the boundary after it
        # The same on every rank (the same step count): launched and read by all, or by none.
        on = (guard.step_count // block) % 2 == 0
        guard.flag_hold.on = on
        last = (now, on)
        guard.step(batch)
    guard.close()
    return {"on": times[True], "off": times[False]}


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--pairs", type=int, default=30, help="step/check pairs timed per rank")
    p.add_argument("--replays", type=int, default=5, help="replays timed")
    p.add_argument("--block", type=int, default=10, help="steps per on/off block (flag hold)")
    p.add_argument("--blocks", type=int, default=4, help="on/off block pairs (flag hold)")
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports()
        return
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "quiet.yaml"
        policy.write_text(QUIET)
        print(f"example GPT ({sum(p.numel() for p in GPT(CFG).parameters()) / 1e6:.2f}M params), "
              f"gloo, one thread per rank")  # fmt: skip
        for world in (int(w) for w in args.worlds.split(",")):
            ranks = spawn_ranks(_checks, world, Path(tmp) / f"c{world}", args.pairs, str(policy),
                                timeout_s=1800)  # fmt: skip
            step = statistics.median(s for r in ranks for s in r["steps"])
            check = statistics.median(c for r in ranks for c in r["checks"])
            share = check / step
            print(
                f"replica check, {world} ranks: step {step * 1e3:.1f} ms, check {check * 1e3:.2f} ms "
                f"= {share:.2%} of a step; every {DEFAULT_EVERY} steps (the default) "
                f"{share / DEFAULT_EVERY:.3%}; under 0.1% from every {max(1, round(share / 0.001))} "
                f"steps (load {_load()})"
            )
        world = 2
        ranks = spawn_ranks(_replays, world, Path(tmp) / "r", args.replays, str(policy),
                            timeout_s=1800)  # fmt: skip
        step = statistics.median(s for r in ranks for s in r["steps"])
        replay = statistics.median(x for r in ranks for x in r["replays"])
        keep = statistics.median(ranks[-1]["keeps"])
        parts = {
            name: statistics.median(ph[name] for r in ranks for ph in r["phases"])
            for name in ranks[0]["phases"][0]
        }
        print(
            f"replay, {world} ranks: {replay * 1e3:.0f} ms = {replay / step:.1f} steps of "
            f"{step * 1e3:.0f} ms (median of {len(ranks[0]['replays'])}); the flagged step that "
            f"kept its state {keep * 1e3:.0f} ms = {keep / step:.2f} steps (load {_load()})"
        )
        print(
            "  of which (median ms): " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in parts.items())
        )
        for world in (int(w) for w in args.worlds.split(",")):
            ranks = spawn_ranks(_flag_cost, world, Path(tmp) / f"f{world}", args.blocks,
                                args.block, str(policy), timeout_s=1800)  # fmt: skip
            on = statistics.median(t for r in ranks for t in r["on"])
            off = statistics.median(t for r in ranks for t in r["off"])
            n = sum(len(r["on"]) for r in ranks)
            print(
                f"flag hold, {world} ranks: iteration {on * 1e3:.1f} ms with it, {off * 1e3:.1f} "
                f"ms without (medians of {n} each): ratio {on / off:.3f} (load {_load()})"
            )


if __name__ == "__main__":
    main()
