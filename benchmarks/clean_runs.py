"""Clean runs raise nothing: the example loops under every default detector and the default policy.

    python benchmarks/clean_runs.py                 # every job, 3 seeds, full length
    python benchmarks/clean_runs.py --jobs mlp --seeds 0 1
    python benchmarks/clean_runs.py --jobs nanogpt_2r   # the 2-rank job alone

Each job is one of `examples/loops/*.py` (or the example GPT), run alone in
this process with a run directory, exactly as a user would run it; the
table counts the lines of its `anomalies.jsonl` and `decisions.jsonl`. A
healthy run must show 0 and 0: a remediation system that rolls back
healthy training gets switched off.

The group jobs (`GROUP_JOBS`) run as `remedy run --workers N` does, on a
private local Ray: `nanogpt_2r` is nanoGPT's loop on 2 data-parallel ranks
whose rank 0 alone evaluates every `eval_interval` steps while rank 1 waits
for it in the next all-reduce (the phases of `rank.loop.phases`); its
`waited s` column is the longest such wait rank 1 measured (`phase_wait_s`),
to show that the eval did hold rank 1 up. `nanogpt_alleval_2r` has every rank
evaluate together, undeclared, for longer than the hang watch's `behind_s`:
its `quiet s` column (the longest time between two steps of rank 0) shows
how long the ranks were quiet.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._smoke import add_check_imports, check_imports  # noqa: E402
from remedy.rank.loop.target import load_target  # noqa: E402
from remedy.rundir.writer import metrics_paths, read_jsonl  # noqa: E402

# job -> (target, arguments of its full-length run: 1000+ steps)
JOBS: dict[str, tuple[str, list[str]]] = {
    "mlp": ("examples/loops/mlp.py:main", ["--epochs", "10"]),
    "convnet": ("examples/loops/convnet.py:main", ["--epochs", "16"]),
    "char_lstm": ("examples/loops/char_lstm.py:main", ["--epochs", "8"]),
    "amp_mlp": ("examples/loops/amp_mlp.py:main", ["--epochs", "10"]),
    # The framework callbacks: HF Trainer with accumulation and clipping, Lightning with
    # accumulation, clipping and bf16 (1000 optimizer steps each).
    "hf_gpt2": (
        "examples/hf_trainer.py:main",
        ["--steps", "1000", "--nan-at", "0", "--grad-accum", "2"],
    ),
    "lightning": (
        "examples/lightning_module.py:main",
        ["--steps", "1000", "--nan-at", "0", "--accumulate", "2", "--precision", "bf16-mixed"],
    ),
    "gpt": (
        "examples/pretrain_gpt.py:main",
        [
            "--steps",
            "1000",
            "--layers",
            "2",
            "--width",
            "64",
            "--block-size",
            "32",
            "--batch-size",
            "8",
            "--warmup",
            "30",
            "--sample-every",
            "0",
        ],
    ),
}


# job -> (target, arguments, ranks): loops run as a group under a supervisor (`remedy run`).
GROUP_JOBS: dict[str, tuple[str, list[str], int]] = {
    # nanoGPT's rank-0 eval: 1000 held-out batches (2-4 s on a CPU) every 100 of 500 steps.
    "nanogpt_2r": (
        "examples/nanogpt_shaped.py:main",
        ["--max-iters", "500", "--lr-decay-iters", "500", "--eval-interval", "100",
         "--eval-iters", "1000"],
        2,
    ),
    # Every rank evaluates together (as HF's Trainer does), undeclared, for longer than the
    # hang watch's `behind_s` (10 s): no rank is behind, so none may be named hung.
    "nanogpt_alleval_2r": (
        "examples/nanogpt_shaped.py:main",
        ["--max-iters", "300", "--lr-decay-iters", "300", "--eval-interval", "100",
         "--eval-iters", "6000", "--eval-all-ranks"],
        2,
    ),
}  # fmt: skip


@dataclass
class Row:
    job: str
    seed: int
    steps: int
    events: int
    decisions: int
    wall_s: float
    kinds: Counter[str]
    waited_s: float | None = None  # group jobs: the longest wait for a peer's phase
    quiet_s: float | None = None  # group jobs: the longest time between two steps of rank 0


def run_job(job: str, seed: int, run_dir: Path, extra: list[str] | None = None) -> Row:
    """Run one job alone (single-process mode) into `run_dir` and count what it raised."""
    target, args = JOBS[job]
    main = load_target(str(ROOT / target))
    argv = [*args, *(extra or []), "--seed", str(seed), "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        result: Any = main(argv)
    wall = time.perf_counter() - t0
    anomalies = read_jsonl(run_dir / "anomalies.jsonl")
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    steps = len(read_jsonl(run_dir / "metrics.jsonl"))
    del result
    return Row(job, seed, steps, len(anomalies), len(decisions), wall,
               Counter(str(a["kind"]) for a in anomalies))  # fmt: skip


def run_group_job(job: str, seed: int, run_dir: Path) -> Row:
    """Run one group job under a supervisor (as `remedy run --workers N`) on the Ray this
    process is connected to, and count what it raised."""
    from remedy.cli.runner import run_supervised  # noqa: PLC0415 - group jobs only (Ray)
    from remedy.protocol.spec import RunSpec  # noqa: PLC0415

    target, args, ranks = GROUP_JOBS[job]
    spec = RunSpec(target=str(ROOT / target), workers=ranks, run_dir=str(run_dir),
                   argv=[*args, "--seed", str(seed)], threads_per_rank=1)  # fmt: skip
    t0 = time.perf_counter()
    summary = run_supervised(spec)
    wall = time.perf_counter() - t0
    if summary.get("status") != "completed":
        raise RuntimeError(f"{job} seed {seed} ended {summary.get('status')}: {summary}")
    anomalies = read_jsonl(run_dir / "anomalies.jsonl")
    decisions = read_jsonl(run_dir / "decisions.jsonl")
    records = [m for p in metrics_paths(run_dir) for m in read_jsonl(p)]
    steps = sum(1 for m in records if m.get("rank") == 0)
    waited = max((float(m.get("phase_wait_s", 0.0)) for m in records), default=0.0)
    ends = sorted(float(m["t_end"]) for m in records if m.get("rank") == 0 and "t_end" in m)
    quiet = max((b - a for a, b in pairwise(ends)), default=0.0)
    return Row(job, seed, steps, len(anomalies), len(decisions), wall,
               Counter(str(a["kind"]) for a in anomalies), waited, quiet)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = [*JOBS, *GROUP_JOBS]
    p.add_argument("--jobs", nargs="+", default=every, choices=every)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports(
            targets=(
                *(target for target, _ in JOBS.values()),
                *(target for target, _, _ in GROUP_JOBS.values()),
            )
        )
        return
    torch.set_num_threads(args.threads)
    if any(job in GROUP_JOBS for job in args.jobs):
        import ray  # noqa: PLC0415 - group jobs only

        ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, logging_level="ERROR")  # fmt: skip
    print(
        f"{'job':<10} {'seed':>4} {'steps':>6} {'events':>6} {'decisions':>9} {'wall s':>7} "
        f"{'waited s':>8} {'quiet s':>7}  kinds"
    )
    total = Counter[str]()
    with tempfile.TemporaryDirectory() as tmp:
        for job in args.jobs:
            for seed in args.seeds:
                run_dir = Path(tmp) / f"{job}-{seed}"
                row = (run_group_job if job in GROUP_JOBS else run_job)(job, seed, run_dir)
                total.update(row.kinds)
                kinds = ", ".join(f"{k}x{n}" for k, n in sorted(row.kinds.items())) or "-"
                waited = f"{row.waited_s:>8.2f}" if row.waited_s is not None else f"{'-':>8}"
                quiet = f"{row.quiet_s:>7.2f}" if row.quiet_s is not None else f"{'-':>7}"
                print(
                    f"{row.job:<10} {row.seed:>4} {row.steps:>6} {row.events:>6} "
                    f"{row.decisions:>9} {row.wall_s:>7.1f} {waited} {quiet}  {kinds}",
                    flush=True,
                )
    print(f"events by kind over all runs: {dict(total) or 'none'}")


if __name__ == "__main__":
    main()
