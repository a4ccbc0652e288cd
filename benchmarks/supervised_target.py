"""The supervised rows of `overhead.py`: the example's step time under `remedy run`, guarded or plain.

`main` is a `remedy run` target: the example GPT (examples/pretrain_gpt.py's
defaults: 4 layers, width 128, 64 tokens, batches of 16), DDP when the run
has several ranks, trained `--steps` steps either through a `Guard` at its
defaults (every default detector, reports to the supervisor, snapshots every
10 steps, durable checkpoints every 100 into the run directory) or as the
same plain loop with no Guard. It returns this rank's step times, so the
run's `summary.json` carries them.

`--mode interleaved` trains both in the same ranks of one `remedy run`: two
copies of the model from the same weights, each its own DDP, on the same
batches, in alternating chunks of `--chunk` steps (guarded then plain, then
plain then guarded, ...), so that machine noise, a busy neighbour or a slow
rank hits both sides alike. It returns the median step time of each side in
each pair of chunks; `interleaved` runs it and gives the median of the pairs'
ratios with a 95% bootstrap interval over the pairs. With `--pieces` it also
returns the µs per step of each piece of both sides (`_pieces.Pieces`).
Rank 0 also counts the CPU time each side's chunks cost (`CpuTally`): its
own process (the training thread and the Guard's threads), its training
thread alone, and the supervisor's process (read from /proc, the supervisor
being on this machine). Wall time on a shared 2-core machine is noise; CPU
seconds per step are not, and where the ranks keep the cores busy the
guarded side's wall time grows by its extra CPU over the cores.

`compare` runs both modes as separate `remedy run`s at each world size,
alternating which goes first, and gives the ratio of the median step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET = f"{Path(__file__).resolve()}:main"

from benchmarks._pieces import Pieces  # noqa: E402
from benchmarks.agent_hosts import cpu_s  # noqa: E402

# What `CpuTally` counts, in the order of its marks.
CPU_SOURCES = ("rank process", "training thread", "supervisor")


class CpuTally:
    """CPU seconds per side over the timed chunks: this process, its training thread, the
    supervisor's process (when its process id is known and readable)."""

    def __init__(self, supervisor_pid: int | None) -> None:
        self.pid = supervisor_pid
        self.steps = {"guarded": 0, "plain": 0}
        self.seconds = {side: dict.fromkeys(CPU_SOURCES, 0.0) for side in self.steps}

    def _mark(self) -> tuple[float, float, float | None]:
        supervisor = None
        if self.pid is not None:
            try:
                supervisor = cpu_s(self.pid)
            except OSError:
                self.pid = None  # gone (a restarted supervisor is another process): stop counting
        return time.process_time(), time.thread_time(), supervisor

    def run(self, side: str, chunk: Callable[[], list[float]], *, timed: bool) -> list[float]:
        """Run one chunk of `side`; its CPU seconds count when `timed`."""
        start = self._mark()
        out = chunk()
        if timed:
            for name, a, b in zip(CPU_SOURCES, start, self._mark(), strict=True):
                if a is not None and b is not None:
                    self.seconds[side][name] += b - a
            self.steps[side] += len(out)
        return out

    def per_step_ms(self) -> dict[str, dict[str, float]]:
        return {
            side: {k: 1e3 * v / max(1, self.steps[side]) for k, v in parts.items()}
            for side, parts in self.seconds.items()
        }


def main(argv: list[str]) -> dict[str, Any]:
    """Train `--steps` steps guarded or plain; return the step times after `--warmup`."""
    import torch  # noqa: PLC0415 - imported in the rank, not by `overhead.py --supervised`
    import torch.distributed as dist  # noqa: PLC0415

    from examples.gpt_model import (  # noqa: PLC0415
        GPT,
        GPTConfig,
        SyntheticCorpus,
        cosine_with_warmup,
        lm_loss,
    )
    from remedy import Guard, get_context  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="supervised_target")
    p.add_argument("--mode", choices=("guarded", "plain", "interleaved"), required=True)
    p.add_argument("--chunk", type=int, default=10, help="steps per chunk (interleaved)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--pieces", action="store_true", help="time each piece of both sides' steps")
    # Set in the thread that trains, for both modes alike: under load, two intra-op
    # threads on 2 cores made the plain loop 7-12x slower than the guarded one.
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ctx = get_context()
    rank, world = (ctx.rank, ctx.world_size) if ctx else (0, 1)
    torch.manual_seed(0)
    model: torch.nn.Module = GPT(GPTConfig())
    if world > 1 and dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(30, args.steps))
    corpus = SyntheticCorpus(block_size=64, batch_size=16, seed=0)

    def batch(i: int) -> torch.Tensor:
        return corpus.batch(i * world + rank)

    if args.mode == "interleaved":
        return _interleaved(args, model, opt, sched, batch, world)
    times: list[float] = []
    last = time.perf_counter()
    if args.mode == "guarded":
        guard = Guard(model, opt, loss_fn=lm_loss, data=batch, scheduler=sched,
                      max_steps=args.steps)  # fmt: skip
        for b in guard:  # the boundary (commands, snapshots, reports) is inside each interval
            guard.step(b)
            now = time.perf_counter()
            times.append(now - last)
            last = now
        guard.close()
    else:
        for i in range(args.steps):
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model, batch(i))
            loss.backward()
            opt.step()
            sched.step()
            now = time.perf_counter()
            times.append(now - last)
            last = now
    kept = times[args.warmup :]
    return {"mode": args.mode, "median_s": statistics.median(kept), "steps_timed": len(kept),
            "torch_threads": torch.get_num_threads()}  # fmt: skip


def _interleaved(
    args: argparse.Namespace, model: Any, opt: Any, sched: Any, batch: Any, world: int
) -> dict[str, Any]:
    """Both sides in this rank, in alternating chunks; each pair's median step times."""
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from examples.gpt_model import cosine_with_warmup, lm_loss  # noqa: PLC0415
    from remedy import Guard, get_context  # noqa: PLC0415
    from remedy.rundir.claim import claimed_supervisors  # noqa: PLC0415

    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    twin: torch.nn.Module = copy.deepcopy(inner)
    if world > 1 and dist.is_initialized():
        twin = torch.nn.parallel.DistributedDataParallel(twin)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    twin_sched = torch.optim.lr_scheduler.LambdaLR(twin_opt, cosine_with_warmup(30, args.steps))
    guard = Guard(model, opt, loss_fn=lm_loss, data=batch, scheduler=sched, max_steps=args.steps)
    pieces = Pieces()
    ctx = get_context()
    pids = claimed_supervisors(ctx.run_dir) if ctx is not None and ctx.run_dir else {}
    cpu = CpuTally(pids[max(pids)] if pids else None)
    if args.pieces:
        pieces.wrap_guard(guard)
    it = iter(guard)
    plain_step = 0
    timed_steps = 0

    def guarded_chunk() -> list[float]:
        times = []
        last = time.perf_counter()
        for _ in range(args.chunk):
            guard.step(next(it))  # the boundary (commands, snapshots, reports) is in `next`
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return times

    def plain_chunk() -> list[float]:
        nonlocal plain_step
        times = []
        last = time.perf_counter()
        for _ in range(args.chunk):
            if args.pieces:
                pieces.timed("plain: zero_grad", lambda: twin_opt.zero_grad(set_to_none=True))
                pieces.timed("plain: forward_backward",
                             lambda i=plain_step: lm_loss(twin, batch(i)).backward())  # fmt: skip
                pieces.timed("plain: optimizer step", twin_opt.step)
                pieces.timed("plain: scheduler step", twin_sched.step)
            else:
                twin_opt.zero_grad(set_to_none=True)
                lm_loss(twin, batch(plain_step)).backward()
                twin_opt.step()
                twin_sched.step()
            plain_step += 1
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return times

    pairs: list[tuple[float, float]] = []
    warm = max(1, args.warmup // args.chunk)
    for i in range(args.steps // args.chunk):
        pieces.on = args.pieces and i >= warm
        timed_steps += args.chunk if pieces.on else 0
        timed = i >= warm
        if i % 2 == 0:
            g = cpu.run("guarded", guarded_chunk, timed=timed)
            pl = cpu.run("plain", plain_chunk, timed=timed)
        else:
            pl = cpu.run("plain", plain_chunk, timed=timed)
            g = cpu.run("guarded", guarded_chunk, timed=timed)
        pieces.add("guarded step (whole)", sum(g))
        pieces.add("plain step (whole)", sum(pl))
        # The first step of a chunk pays for the switch from the other model: left out.
        pairs.append((statistics.median(g[1:]), statistics.median(pl[1:])))
    pieces.on = False
    guard.close()
    return {"mode": "interleaved", "pairs": pairs[warm:], "chunk": args.chunk,
            "torch_threads": torch.get_num_threads(),
            "pieces_us": pieces.per_step(timed_steps),
            "pieces_median_us": pieces.typical(timed_steps),
            "cpu_ms_per_step": cpu.per_step_ms(),
            "cpu_supervisor_counted": cpu.pid is not None}  # fmt: skip


def _one(mode: str, workers: int, steps: int, tmp: Path, i: int) -> float:
    """One `remedy run`; rank 0's median step time."""
    run_dir = tmp / f"{mode}-{workers}-{i}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    cmd = [sys.executable, "-m", "remedy.cli", "run", TARGET, "--workers", str(workers),
           "--run-dir", str(run_dir), "--quiet", "--", "--mode", mode, "--steps", str(steps)]  # fmt: skip
    return float(_rank0(cmd, env, run_dir, f"{mode} x{workers}")["median_s"])


def _rank0(cmd: list[str], env: dict[str, str], run_dir: Path, what: str) -> dict[str, Any]:
    """Run one `remedy run`; rank 0's result."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=1800)
    if proc.returncode != 0:
        # `--quiet` puts the display's JSON lines on stdout: the summary's error is the last.
        tail = (proc.stdout.strip().splitlines() or [""])[-1][-800:]
        raise RuntimeError(f"remedy run {what} exited {proc.returncode}: {tail} "
                           f"{proc.stderr[-400:]}")  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    rank0 = next(r for r in summary["ranks"] if r.get("rank") == 0)
    return dict(rank0["result"])


def interleaved(
    workers: int, steps: int, chunk: int, *, pieces: bool = False, dry_run: bool = False
) -> dict[str, Any]:
    """One `remedy run` of `workers` ranks training both sides in alternating chunks: the
    median of the pairs' guarded/plain ratios and its 95% bootstrap interval over the pairs;
    with `pieces`, rank 0's µs per step of each piece of both sides (`_pieces.Pieces`).
    `dry_run`: the supervisor decides and journals but does not act (`remedy run --dry-run`)."""
    with tempfile.TemporaryDirectory() as tmp_s:
        run_dir = Path(tmp_s) / f"interleaved-{workers}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
        cmd = [sys.executable, "-m", "remedy.cli", "run", TARGET, "--workers", str(workers),
               "--run-dir", str(run_dir), "--quiet", *(["--dry-run"] if dry_run else []),
               "--", "--mode", "interleaved", "--steps", str(steps), "--chunk", str(chunk)]  # fmt: skip
        if pieces:
            cmd.append("--pieces")
        result = _rank0(cmd, env, run_dir, f"interleaved x{workers}")
    pairs = [tuple(p) for p in result["pairs"]]
    ratios = [g / p for g, p in pairs]
    lo, hi = bootstrap_interval(ratios)
    return {"workers": workers, "ratio": statistics.median(ratios), "lo": lo, "hi": hi,
            "pairs": len(pairs), "guarded_ms": statistics.median(g for g, _ in pairs) * 1e3,
            "plain_ms": statistics.median(p for _, p in pairs) * 1e3,
            "pieces_us": result.get("pieces_us", {}),
            "pieces_median_us": result.get("pieces_median_us", {}),
            "cpu_ms_per_step": result.get("cpu_ms_per_step", {}),
            "cpu_supervisor_counted": result.get("cpu_supervisor_counted", False)}  # fmt: skip


def bootstrap_interval(
    values: list[float], *, level: float = 0.95, draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """The `level` percentile bootstrap interval of the median of `values`."""
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    tail = (1 - level) / 2
    return medians[int(tail * draws)], medians[min(int((1 - tail) * draws), draws - 1)]


def compare(workers: list[int], steps: int, repeat: int) -> Iterator[dict[str, Any]]:
    """Per world size, as each is done: plain and guarded medians over `repeat` interleaved
    runs each, and the ratio."""
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for w in workers:
            plain: list[float] = []
            guarded: list[float] = []
            for i in range(repeat):
                order = ("plain", "guarded") if i % 2 == 0 else ("guarded", "plain")
                for mode in order:
                    (plain if mode == "plain" else guarded).append(_one(mode, w, steps, tmp, i))
            pm, gm = statistics.median(plain), statistics.median(guarded)
            yield {"workers": w, "plain_ms": pm * 1e3, "guarded_ms": gm * 1e3,
                   "ratio": gm / pm, "runs": repeat,
                   "pairs": [g / p for g, p in zip(guarded, plain, strict=True)]}  # fmt: skip
