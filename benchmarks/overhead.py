"""What the Guard costs: guarded vs plain step time on the same model and data, in one process.

Two copies of the example GPT start from the same weights and train on the
same batches: one through `workers.Guard` with every default detector on
and snapshots at the default period, one in an equally lean plain loop
(`zero_grad(set_to_none=True)`, `loss.backward()`, `optimizer.step()`,
`scheduler.step()`). Blocks of steps alternate between them (plain first in
even rounds, guarded first in odd ones), so drifts in machine load hit both
alike. Printed per configuration: the median over rounds of the ratio of
block-median step times (the per-step overhead), its spread, and the median
ratio of block means (which also carries the snapshot steps). Snapshots are
then counted apart, amortized over the period as a share of the plain step:
"in run" is the mean extra time of the guarded steps that began with a
snapshot (while the ring fills, every snapshot lands in fresh memory);
"alone" is `take_snapshot()` timed directly with its result dropped, so the
allocator hands the same memory back (what a full ring that recycles its
oldest snapshot could cost), and "recycled", `take_snapshot(into=...)` copying
into an old snapshot's buffers as a full ring does. Then the cost of each default detector per
step on the tiny model's real batches, and the Guard's own per-step pieces
as they are and in their cheaper forms.

    python benchmarks/overhead.py            # tiny and ~50M-parameter configs
    python benchmarks/overhead.py --quick    # fewer rounds, for a smoke run
    python benchmarks/overhead.py --profile  # cProfile of the tiny config's guarded steps

Timings on a shared machine are noisy: compare medians, rerun, and keep
`--threads 1` (the default) where other jobs compete for the cores.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere in the repo

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss  # noqa: E402
from workers import Guard, GuardConfig  # noqa: E402
from workers.detectors import default_detectors  # noqa: E402
from workers.measure import global_grad_norm, memory_in_use  # noqa: E402
from workers.stats import StepStats  # noqa: E402


def cosine_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    """The example's schedule (examples/pretrain_gpt.py): linear warm-up, cosine decay to 10%."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass(frozen=True)
class Setup:
    name: str
    cfg: GPTConfig
    batch: int
    rounds: int
    steps: int  # per block
    warmup: int


TINY = Setup("tiny", GPTConfig(n_layer=2, n_embd=64, block_size=32), 8, 12, 40, 30)
# ~50.6M parameters: 8 blocks of width 704 and a 4096-token vocabulary.
BIG = Setup(
    "50M", GPTConfig(n_layer=8, n_embd=704, n_head=8, block_size=128, vocab_size=4096), 4, 6, 5, 2
)


class Trainer:
    """One model, optimizer, scheduler and batch stream; `step()` runs one step."""

    def __init__(self, s: Setup, total: int, *, guarded: bool, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = GPT(s.cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, cosine_with_warmup(30, total))
        self.corpus = SyntheticCorpus(
            vocab_size=s.cfg.vocab_size, block_size=s.cfg.block_size, batch_size=s.batch, seed=seed
        )
        self.index = 0
        self.guard: Guard | None = None
        if guarded:
            config = GuardConfig(detectors=default_detectors(self.model))
            self.guard = Guard(
                self.model,
                self.opt,
                loss_fn=lm_loss,
                data=self.corpus.batch,
                scheduler=self.sched,
                max_steps=total,
                config=config,
            )
            self._it = iter(self.guard)

    def step(self) -> bool:
        """One step; True when it began with a snapshot (taken at the boundary before it)."""
        if self.guard is not None:
            snap = self.guard.step_count % self.guard.config.snapshot_every == 0
            self.guard.step(next(self._it))
            return snap
        batch = self.corpus.batch(self.index)
        self.index += 1
        self.opt.zero_grad(set_to_none=True)
        loss = lm_loss(self.model, batch)
        loss.backward()
        self.opt.step()
        self.sched.step()
        return False


def timed_block(step: Callable[[], bool], n: int) -> list[tuple[float, bool]]:
    """(seconds, began with a snapshot) for each of `n` steps."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        snap = step()
        out.append((time.perf_counter() - t0, snap))
    return out


def compare(s: Setup, rounds: int, profile: bool = False) -> dict[str, Any]:
    total = s.warmup + rounds * s.steps + 1
    plain, guarded = Trainer(s, total, guarded=False), Trainer(s, total, guarded=True)
    n_params = plain.model.num_params()
    for _ in range(s.warmup):
        plain.step()
        guarded.step()
    ratios: list[float] = []
    mean_ratios: list[float] = []
    p_all: list[float] = []
    g_all: list[tuple[float, bool]] = []
    prof = cProfile.Profile() if profile else None
    for r in range(rounds):
        order = [(plain, False), (guarded, True)]
        blocks: dict[bool, list[float]] = {}
        for trainer, is_guarded in order if r % 2 == 0 else order[::-1]:
            if prof is not None and is_guarded:
                prof.enable()
            timed = timed_block(trainer.step, s.steps)
            if prof is not None and is_guarded:
                prof.disable()
            blocks[is_guarded] = [t for t, _ in timed]
            if is_guarded:
                g_all += timed
            else:
                p_all += blocks[False]
        ratios.append(statistics.median(blocks[True]) / statistics.median(blocks[False]))
        mean_ratios.append(statistics.fmean(blocks[True]) / statistics.fmean(blocks[False]))
    assert guarded.guard is not None
    every = guarded.guard.config.snapshot_every
    plain_med = statistics.median(p_all)
    guard_med = statistics.median(t for t, snap in g_all if not snap)
    # In the run: what a snapshot step costs beyond an ordinary guarded step.
    snap_steps = [t for t, snap in g_all if snap]
    snap_extra = statistics.fmean(snap_steps) - guard_med if snap_steps else math.nan
    # Alone: take_snapshot() timed directly, its result dropped (the allocator reuses the memory).
    direct = []
    for _ in range(3):
        t0 = time.perf_counter()
        guarded.guard.take_snapshot()
        direct.append(time.perf_counter() - t0)
    # Recycled: a full ring's steady state, copying into the evicted snapshot's buffers.
    spare = guarded.guard.take_snapshot()
    recycled = []
    for _ in range(3):
        t0 = time.perf_counter()
        guarded.guard.take_snapshot(into=spare)
        recycled.append(time.perf_counter() - t0)
    guarded.guard.close()
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    return {
        "params": n_params,
        "plain_ms": plain_med * 1e3,
        "guarded_ms": guard_med * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "mean_ratio": statistics.median(mean_ratios),
        "snap_extra_ms": snap_extra * 1e3,
        "snap_share": snap_extra / every / plain_med,
        "snap_direct_ms": statistics.median(direct) * 1e3,
        "snap_direct_share": statistics.median(direct) / every / plain_med,
        "snap_recycled_ms": statistics.median(recycled) * 1e3,
        "snap_recycled_share": statistics.median(recycled) / every / plain_med,
    }


def detector_costs(steps: int = 400) -> list[tuple[str, float]]:
    """Microseconds per step of each default detector, on real batches of the tiny setup."""
    torch.manual_seed(0)
    model = GPT(TINY.cfg)
    corpus = SyntheticCorpus(block_size=TINY.cfg.block_size, batch_size=TINY.batch)
    batches = [corpus.batch(i) for i in range(steps)]
    out = []
    for det in default_detectors(model):
        inspect = getattr(det, "inspect_batch", None)
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            if inspect is not None:
                inspect(batch)
            det.observe(_stats(i))
        out.append((det.name, (time.perf_counter() - t0) / steps * 1e6))
    return out


def component_costs(steps: int = 300) -> list[tuple[str, float]]:
    """Median µs of the Guard's own per-step pieces on the tiny model, as they are and as they
    could be (the alternatives recommended for workers/guard.py and workers/measure.py)."""
    torch.manual_seed(0)
    model = GPT(TINY.cfg)
    corpus = SyntheticCorpus(block_size=TINY.cfg.block_size, batch_size=TINY.batch)
    params = [p for p in model.parameters() if p.requires_grad]
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    page = os.sysconf("SC_PAGE_SIZE")

    def fused_norm() -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        return torch.linalg.vector_norm(
            torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)), 2.0
        )

    def loss_times_one() -> None:
        lm_loss(model, batch).mul(1.0).backward()

    def loss_alone() -> None:
        lm_loss(model, batch).backward()

    pieces: dict[str, Callable[[], Any]] = {
        "global_grad_norm (as is)": lambda: global_grad_norm(params),
        "  one _foreach_norm(dtype=fp32) + stack": fused_norm,
        "memory_in_use: open /proc/self/statm": lambda: memory_in_use(torch.device("cpu")),
        "  os.pread on a kept descriptor": lambda: int(os.pread(fd, 64, 0).split()[1]) * page,
        "forward+backward with loss * 1.0": loss_times_one,
        "  forward+backward without the multiply": loss_alone,
    }
    times: dict[str, list[float]] = {k: [] for k in pieces}
    for i in range(steps):
        batch = corpus.batch(i)
        model.zero_grad(set_to_none=True)
        lm_loss(model, batch).backward()  # fresh gradients, caches as after a real step
        for name in list(pieces)[i % len(pieces) :] + list(pieces)[: i % len(pieces)]:
            t0 = time.perf_counter()
            pieces[name]()
            times[name].append(time.perf_counter() - t0)
    os.close(fd)
    return [(k, statistics.median(v) * 1e6) for k, v in times.items()]


def _stats(i: int) -> StepStats:
    return StepStats(
        step=i,
        tick=i,
        rank=0,
        loss=2.0 + 0.01 * (i % 7),
        grad_norm=1.0,
        lr=1e-3,
        step_time_s=0.01,
        loader_time_s=1e-4,
        batch_index=i,
        mem_bytes=300 << 20,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    p.add_argument("--only", choices=["tiny", "50M"], help="run one configuration")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--profile", action="store_true", help="cProfile the tiny guarded blocks")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    print(f"{'config':7} {'params':>11} {'plain ms':>9} {'guard ms':>9} {'ratio':>7} "
          f"{'(min..max)':>15} {'mean ratio':>10} | snapshot: {'in run ms':>9} {'share':>6}"
          f" {'alone ms':>8} {'share':>6}")  # fmt: skip
    for s in (TINY, BIG):
        if args.only and s.name != args.only:
            continue
        rounds = max(2, s.rounds // 3) if args.quick else s.rounds
        r = compare(s, rounds, profile=args.profile and s is TINY)
        print(
            f"{s.name:7} {r['params']:>11,} {r['plain_ms']:9.2f} {r['guarded_ms']:9.2f} "
            f"{r['ratio']:7.4f} {r['ratio_min']:7.4f}..{r['ratio_max']:6.4f} "
            f"{r['mean_ratio']:10.4f} |           {r['snap_extra_ms']:9.1f} {r['snap_share']:6.2%}"
            f" {r['snap_direct_ms']:8.1f} {r['snap_direct_share']:6.2%}",
            flush=True,
        )
        print(
            f"{'':7} snapshot into recycled buffers (a full ring's steady state): "
            f"{r['snap_recycled_ms']:.1f} ms, {r['snap_recycled_share']:.2%} amortized",
            flush=True,
        )
    print("\nper-detector cost (tiny model batches, µs/step, mean over steps):")
    for name, us in detector_costs():
        print(f"  {name:22} {us:8.1f}")
    print("\nGuard pieces on the tiny model (median µs per call):")
    for name, us in component_costs():
        print(f"  {name:42} {us:8.1f}")
    print(f"\ntotal wall {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
