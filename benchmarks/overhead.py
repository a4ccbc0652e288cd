"""What the Guard costs: guarded vs plain step time on the same model and data, in one process.

Two copies of a GPT start from the same weights and train on the same
batches: one through `workers.Guard` with every default detector on and
snapshots at the default period, one in an equally lean plain loop
(`zero_grad(set_to_none=True)`, `loss.backward()`, `optimizer.step()`,
`scheduler.step()`). Their steps are interleaved one by one, in the order
plain-guarded, guarded-plain, ... so drifts in machine load and cache
pollution by the other model hit both alike. Printed per configuration: the
ratio of median step times (guarded steps that began with a snapshot left
out: snapshots are counted apart), the median and spread of that ratio over
ten consecutive chunks of the run, and the ratio of mean step times over
every step (snapshots included). The Guard's added time per step is nearly
fixed, so it is also printed with the step time it would be 1% of.

Configurations: `example` is the shipped example's model and batch
(examples/pretrain_gpt.py defaults, 0.8M parameters); `tiny` a smaller one
(2 layers, width 64, batches of 8x32 tokens; 5 ms steps on one CPU thread,
where the Guard's fixed per-step host work shows most); `50M` a ~50M-parameter
GPT. `tiny+clip` and `example+clip` compare a plain loop that clips gradients at 1.0
(`clip_grad_norm_`, as GPT recipes do) with a Guard doing the same clipping
(`GuardConfig(grad_clip=1.0)`), which reuses its gradient norm for it.

Snapshots are then costed apart, amortized over the period as a share of the
plain step: "in run" is the mean extra time of the guarded steps that began
with a snapshot (while the ring fills, every snapshot lands in fresh memory);
"alone" is `take_snapshot()` timed directly with its result dropped, and
"recycled", `take_snapshot(into=...)` copying into an old snapshot's buffers
as a full ring does. Then the cost of each default detector per step on the
tiny model's real batches, and the Guard's own per-step pieces.

    python benchmarks/overhead.py            # every configuration (~8 min on one core)
    python benchmarks/overhead.py --quick    # fewer steps, for a smoke run
    python benchmarks/overhead.py --only example
    python benchmarks/overhead.py --profile  # cProfile of the tiny config's guarded steps
    python benchmarks/overhead.py --supervised [--sup-workers 1,4] [--sup-steps 400] [--chunk 10]
    python benchmarks/overhead.py --supervised --separate [--sup-repeat 3]
    python benchmarks/overhead.py --supervised --sup-workers 4 --pieces  # where a step's time goes

`--supervised` prints the rows of the real supervised path instead: the
example under `remedy run` (a private local Ray) at 1 rank and at 4 DDP
ranks, with reports, snapshots and durable checkpoints at their defaults
(see `supervised_target.py`). Each world size is one run whose ranks train
a guarded and a plain copy of the model in alternating chunks, so the noise
of this shared machine hits both alike; a row is `supervised N ranks RATIO
[LO, HI]`: the median over pairs of chunks of rank 0's guarded/plain ratio
of median step times, with its 95% bootstrap interval over the pairs. Then
the Guard's per-step pieces (as in the one-process rows). `--separate` runs
each side as its own `remedy run` instead, alternating which goes first.
`--pieces` times each piece of both sides' steps inside the ranks of the run
(`_pieces.py`: the boundary, the step mark, the step's parts, the report, each
in µs per step on rank 0, nested pieces indented) and prints that table under
the row; its wrappers cost a little, so take the ratio from a run without it.
`--dry-run` runs it under `remedy run --dry-run` (the policy decides and
journals but does not act): on a heavily loaded machine a rank starved during
a plain chunk, which reports nothing, can pass the hang watch's bound, and its
restart would end the run; the step's path is the same.

Timings on a shared machine are noisy: compare ratios, rerun, and keep
`--threads 1` (the default) where other jobs compete for the cores.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere in the repo

from benchmarks._smoke import add_check_imports, check_imports  # noqa: E402
from examples.gpt_model import (  # noqa: E402
    GPT,
    GPTConfig,
    SyntheticCorpus,
    cosine_with_warmup,
    lm_loss,
)
from remedy.rank import Guard, GuardConfig  # noqa: E402
from remedy.rank.actions.replay import Replays  # noqa: E402
from remedy.rank.detectors import DetectorSuite, default_detectors  # noqa: E402
from remedy.rank.loop.measure import GradNorm, MemoryProbe, process_rss_bytes  # noqa: E402
from remedy.rank.loop.stats import StepStats  # noqa: E402


@dataclass(frozen=True)
class Setup:
    name: str
    cfg: GPTConfig
    batch: int
    pairs: int  # interleaved plain/guarded step pairs timed
    warmup: int  # pairs run first, untimed
    clip: float | None = None  # gradient clipping in both loops
    lr: float = 3e-3  # the example's peak LR


TINY_CFG = GPTConfig(n_layer=2, n_embd=64, block_size=32)
SETUPS = [
    Setup("tiny", TINY_CFG, 8, pairs=1500, warmup=30),
    Setup("tiny+clip", TINY_CFG, 8, pairs=1500, warmup=30, clip=1.0),
    # examples/pretrain_gpt.py's defaults: 4 layers, width 128, 64 tokens, batches of 16.
    Setup("example", GPTConfig(), 16, pairs=400, warmup=10),
    Setup("example+clip", GPTConfig(), 16, pairs=400, warmup=10, clip=1.0),
    # ~50.6M parameters: 8 blocks of width 704 and a 4096-token vocabulary.
    Setup(
        "50M",
        GPTConfig(n_layer=8, n_embd=704, n_head=8, block_size=128, vocab_size=4096),
        4,
        pairs=60,
        warmup=3,
        # 3e-3 makes this model's loss spike during warm-up (a real one: 4.7 -> 7.4 at
        # step 24, which the Guard rolls back); GPT-2-small-like models train at ~6e-4.
        lr=6e-4,
    ),
]
TINY = SETUPS[0]


class Trainer:
    """One model, optimizer, scheduler and batch stream; `step()` runs one step."""

    def __init__(self, s: Setup, total: int, *, guarded: bool, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = GPT(s.cfg)
        # The example's optimizer (examples/pretrain_gpt.py).
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=s.lr, weight_decay=0.01, betas=(0.9, 0.95)
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, cosine_with_warmup(30, total))
        self.corpus = SyntheticCorpus(
            vocab_size=s.cfg.vocab_size, block_size=s.cfg.block_size, batch_size=s.batch, seed=seed
        )
        self.clip = s.clip
        self.index = 0
        self.guard: Guard | None = None
        if guarded:
            config = GuardConfig(detectors=default_detectors(self.model), grad_clip=s.clip)
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
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        return False


def compare(s: Setup, pairs: int, profile: bool = False) -> dict[str, Any]:
    total = s.warmup + pairs + 1
    plain, guarded = Trainer(s, total, guarded=False), Trainer(s, total, guarded=True)
    n_params = plain.model.num_params()
    for _ in range(s.warmup):
        plain.step()
        guarded.step()
    p_times: list[float] = []
    g_times: list[tuple[float, bool]] = []  # (seconds, began with a snapshot)
    prof = cProfile.Profile() if profile else None
    for i in range(pairs):
        for trainer in (plain, guarded) if i % 2 == 0 else (guarded, plain):
            if prof is not None and trainer is guarded:
                prof.enable()
            t0 = time.perf_counter()
            snap = trainer.step()
            dt = time.perf_counter() - t0
            if prof is not None and trainer is guarded:
                prof.disable()
            if trainer is guarded:
                g_times.append((dt, snap))
            else:
                p_times.append(dt)
    assert guarded.guard is not None
    every = guarded.guard.config.snapshot_every
    plain_med = statistics.median(p_times)
    guard_med = statistics.median(t for t, snap in g_times if not snap)
    chunk = max(pairs // 10, 1)
    chunk_ratios = [
        statistics.median(t for t, snap in g_times[k : k + chunk] if not snap)
        / statistics.median(p_times[k : k + chunk])
        for k in range(0, pairs - chunk + 1, chunk)
    ]
    # In the run: what a snapshot step costs beyond an ordinary guarded step.
    snap_steps = [t for t, snap in g_times if snap]
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
    # What the default policy did in the guarded run (nothing, on a clean run).
    journal = guarded.guard.reporter.controller.decisions  # type: ignore[attr-defined]
    actions = [f"{d['anomaly']['kind']}@{d['step']}->{d['action']}" for d in journal]
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    return {
        "params": n_params,
        "plain_ms": plain_med * 1e3,
        "guarded_ms": guard_med * 1e3,
        "extra_us": (guard_med - plain_med) * 1e6,
        "ratio": guard_med / plain_med,
        "chunk_median": statistics.median(chunk_ratios),
        "chunk_min": min(chunk_ratios),
        "chunk_max": max(chunk_ratios),
        "mean_ratio": statistics.fmean(t for t, _ in g_times) / statistics.fmean(p_times),
        "actions": actions,  # remediations the default policy took (none on a clean run)
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


def component_costs(steps: int = 600) -> list[tuple[str, float, float]]:
    """Median and mean µs of the Guard's own per-step pieces on the tiny model, each timed right after a
    real forward and backward (one piece per step, in turn), as the Guard meets them: with the
    caches full of the step's tensors rather than warm from the previous call."""
    torch.manual_seed(0)
    model = GPT(TINY.cfg)
    corpus = SyntheticCorpus(block_size=TINY.cfg.block_size, batch_size=TINY.batch)
    params = [p for p in model.parameters() if p.requires_grad]
    norm = GradNorm(params)
    probe = MemoryProbe(torch.device("cpu"))
    suite = DetectorSuite(default_detectors(model, hardware=False))
    stats = _stats(0)

    def detectors() -> None:
        suite.observe(stats)
        stats.step += 1
        stats.tick += 1

    replays = Replays(8, 5.0)
    # What `Replays.mark` reads of the Guard: the step, tick and data position.
    position = SimpleNamespace(step_count=0, tick=0, cursor=SimpleNamespace(position=0))

    def mark() -> None:
        replays.mark(position)  # type: ignore[arg-type]
        position.step_count += 1
        position.tick += 1

    pieces: dict[str, Callable[[], Any]] = {
        "gradient norm (GradNorm, one _foreach_norm)": lambda: norm().item(),
        "RSS from /proc (every read)": process_rss_bytes,
        "MemoryProbe.read (RSS at most every 20 ms)": probe.read,
        "StepStats + metrics record": lambda: _stats(1).to_metrics(),
        "every default detector (DetectorSuite)": detectors,
        "DetectorSuite.flags (before the update)": lambda: suite.flags(2.0, 1.0, scaled=False),
        "step mark for replay_step (Replays.mark)": mark,
    }
    names = list(pieces)
    times: dict[str, list[float]] = {k: [] for k in pieces}
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        lm_loss(model, corpus.batch(i)).backward()
        name = names[i % len(names)]
        t0 = time.perf_counter()
        pieces[name]()
        times[name].append(time.perf_counter() - t0)
        if pieces[name] != probe.read:
            probe.read()  # the Guard reads it every step
    return [(k, statistics.median(v) * 1e6, statistics.fmean(v) * 1e6) for k, v in times.items()]


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


def supervised(args: argparse.Namespace) -> None:
    """The supervised rows: guarded vs plain under `remedy run`, per world size."""
    import os  # noqa: PLC0415

    from benchmarks.supervised_target import compare as supervised_compare  # noqa: PLC0415
    from benchmarks.supervised_target import interleaved  # noqa: PLC0415

    workers = [int(w) for w in args.sup_workers.split(",")]
    if not args.separate:
        print(f"under remedy run, both sides in the same ranks: {args.sup_steps} steps of each in "
              f"chunks of {args.chunk}, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        for w in workers:
            r = interleaved(w, args.sup_steps, args.chunk, pieces=args.pieces,
                            dry_run=args.dry_run)  # fmt: skip
            print(f"supervised {w} ranks {r['ratio']:.4f} [{r['lo']:.4f}, {r['hi']:.4f}]  "
                  f"(plain {r['plain_ms']:.2f} ms, guarded {r['guarded_ms']:.2f} ms, "
                  f"{r['pairs']} pairs of chunks)", flush=True)  # fmt: skip
            if r["cpu_ms_per_step"]:
                print_cpu(w, r["cpu_ms_per_step"], counted=r["cpu_supervisor_counted"])
            if r["pieces_us"]:
                print_pieces(r["pieces_us"], r["pieces_median_us"])
        print(
            "\nGuard pieces on the tiny model, right after a backward (µs per call: median, mean):"
        )
        for name, median, mean in component_costs():
            print(f"  {name:44} {median:8.1f} {mean:8.1f}")
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
        return
    print(f"under remedy run: {args.sup_steps} steps a run (20 untimed), {args.sup_repeat} runs "
          f"of each mode per world size, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'ranks':>6} {'plain ms':>9} {'guarded ms':>11} {'ratio':>7}  per-pair ratios")
    for r in supervised_compare(workers, args.sup_steps, args.sup_repeat):
        pairs = ", ".join(f"{x:.3f}" for x in r["pairs"])
        print(f"{r['workers']:>6} {r['plain_ms']:9.2f} {r['guarded_ms']:11.2f} {r['ratio']:7.4f}  {pairs}",
              flush=True)  # fmt: skip
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


def print_cpu(world: int, cpu: dict[str, dict[str, float]], *, counted: bool) -> None:
    """CPU ms per step of each side (rank 0's process and training thread, the supervisor's
    process), and the machine-wide estimate: every rank costs what rank 0 does."""
    g, p = cpu["guarded"], cpu["plain"]
    print("  CPU ms per step (rank 0; the supervisor's process"
          f"{'' if counted else ' not readable: left out'}):")  # fmt: skip
    print(f"    {'':20} {'plain':>8} {'guarded':>8} {'extra':>8}")
    for k in ("rank process", "training thread", "supervisor"):
        print(f"    {k:20} {p[k]:8.2f} {g[k]:8.2f} {g[k] - p[k]:8.2f}")
    total_g = world * g["rank process"] + g["supervisor"]
    total_p = world * p["rank process"] + p["supervisor"]
    print(f"    {f'{world} ranks + supervisor':20} {total_p:8.2f} {total_g:8.2f} "
          f"{total_g - total_p:8.2f}   CPU ratio {total_g / total_p:.4f}")  # fmt: skip


def print_pieces(pieces: dict[str, float], medians: dict[str, float] | None = None) -> None:
    """Rank 0's µs per step of each piece of a `--pieces` run (`_pieces`), as measured there
    (wrapped calls; a piece called inside another indented under it): the mean over the steps
    and the median call times its calls per step; and what the outermost pieces leave
    unaccounted (means)."""
    medians = medians or {}
    print("  rank 0, µs per step (timed with wrappers: this run's ratio is not the figure):")
    print(f"    {'':52} {'mean':>9} {'median':>9}")
    for key, us in pieces.items():
        if not key.startswith("(") and "(whole)" not in key:
            *callers, name = key.split(" / ")
            median = medians.get(key, math.nan)
            print(
                f"    {'  ' * len(callers)}{name:{52 - 2 * len(callers)}} {us:9.1f} {median:9.1f}"
            )
    whole, plain = pieces.get("guarded step (whole)", 0.0), pieces.get("plain step (whole)", 0.0)
    outer = pieces.get("(outermost pieces together)", 0.0)
    print(f"    {'guarded step (whole)':52} {whole:9.1f}")
    print(f"    {'  outside the pieces (loop, yield, the rest)':52} {whole - outer:9.1f}")
    print(f"    {'plain step (whole)':52} {plain:9.1f}")
    print(f"    {'guarded - plain':52} {whole - plain:9.1f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    p.add_argument("--only", choices=[s.name for s in SETUPS], help="run one configuration")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--profile", action="store_true", help="cProfile the tiny guarded steps")
    p.add_argument("--supervised", action="store_true", help="the rows under `remedy run`")
    p.add_argument("--sup-workers", default="1,4", help="world sizes for --supervised")
    p.add_argument("--sup-steps", type=int, default=400, help="steps of each side per run")
    p.add_argument("--chunk", type=int, default=10, help="steps per chunk (--supervised)")
    p.add_argument("--separate", action="store_true", help="one remedy run per side (--supervised)")
    # Under heavy load a rank starved of CPU during a plain chunk (which reports nothing) can
    # pass the hang watch's bound and be restarted, ending the run: decide but do not act.
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the supervisor decides but does not act (--supervised, a loaded machine)",
    )
    p.add_argument("--pieces", action="store_true",
                   help="time each piece of the step in the ranks (--supervised)")  # fmt: skip
    p.add_argument("--sup-repeat", type=int, default=3, help="runs of each side (--separate)")
    add_check_imports(p)
    args = p.parse_args(argv)
    if args.check_imports:
        check_imports(
            "benchmarks.supervised_target",
            "torch.distributed",
            targets=("benchmarks/supervised_target.py:main",),
            run_modules=("remedy.cli",),
        )
        return
    if args.supervised:
        supervised(args)
        return
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    print(f"{'config':12} {'params':>11} {'plain ms':>9} {'guard ms':>9} {'extra us':>8} "
          f"{'ratio':>7} | {'chunks: median':>14} {'(min..max)':>15} | {'mean ratio':>10}")  # fmt: skip
    results = {}
    for s in SETUPS:
        if args.only and s.name != args.only:
            continue
        pairs = max(20, s.pairs // 5) if args.quick else s.pairs
        r = results[s.name] = compare(s, pairs, profile=args.profile and s is TINY)
        print(
            f"{s.name:12} {r['params']:>11,} {r['plain_ms']:9.2f} {r['guarded_ms']:9.2f} "
            f"{r['extra_us']:8.0f} {r['ratio']:7.4f} | {r['chunk_median']:14.4f} "
            f"{r['chunk_min']:7.4f}..{r['chunk_max']:6.4f} | {r['mean_ratio']:10.4f}"
            + (f"  (policy acted: {', '.join(r['actions'])})" if r["actions"] else ""),
            flush=True,
        )
    # The Guard adds a roughly fixed amount of host work per step (the gradient norm, the
    # detectors, bookkeeping), so its share falls as steps grow: 1% of a step this long.
    print("\nadded time per step, and the step time at which it would be 1%:")
    for name, r in results.items():
        if r["extra_us"] > 0:
            print(
                f"  {name:12} {r['extra_us']:8.0f} µs -> 1% of a {r['extra_us'] / 10:7.1f} ms step"
            )
        else:
            print(
                f"  {name:12} {r['extra_us']:8.0f} µs (within the noise of {r['plain_ms']:.0f} ms steps)"
            )
    print("\nsnapshots (every 10 steps), amortized as a share of the plain step:")
    for name, r in results.items():
        print(
            f"  {name:12} in run {r['snap_extra_ms']:8.1f} ms {r['snap_share']:6.2%} | "
            f"alone {r['snap_direct_ms']:7.1f} ms {r['snap_direct_share']:6.2%} | "
            f"recycled {r['snap_recycled_ms']:7.1f} ms {r['snap_recycled_share']:6.2%}"
        )
    print("\nper-detector cost (tiny model batches, µs/step, mean over steps):")
    for name, us in detector_costs():
        print(f"  {name:22} {us:8.1f}")
    print("\nGuard pieces on the tiny model, right after a backward (µs per call: median, mean):")
    for name, median, mean in component_costs():
        print(f"  {name:44} {median:8.1f} {mean:8.1f}")
    print(f"\ntotal wall {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
