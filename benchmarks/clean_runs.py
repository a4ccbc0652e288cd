"""Clean runs raise nothing: the example loops under every default detector and the default policy.

    python benchmarks/clean_runs.py                 # every job, 3 seeds, full length
    python benchmarks/clean_runs.py --jobs mlp --seeds 0 1

Each job is one of `examples/loops/*.py` (or the example GPT), run alone in
this process with a run directory, exactly as a user would run it; the
table counts the lines of its `anomalies.jsonl` and `decisions.jsonl`. A
healthy run must show 0 and 0: a remediation system that rolls back
healthy training gets switched off.
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
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._smoke import add_check_imports, check_imports  # noqa: E402
from remedy.rank.loop.target import load_target  # noqa: E402
from remedy.rundir.writer import read_jsonl  # noqa: E402

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


@dataclass
class Row:
    job: str
    seed: int
    steps: int
    events: int
    decisions: int
    wall_s: float
    kinds: Counter[str]


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports(targets=tuple(target for target, _ in JOBS.values()))
        return
    torch.set_num_threads(args.threads)
    print(
        f"{'job':<10} {'seed':>4} {'steps':>6} {'events':>6} {'decisions':>9} {'wall s':>7}  kinds"
    )
    total = Counter[str]()
    with tempfile.TemporaryDirectory() as tmp:
        for job in args.jobs:
            for seed in args.seeds:
                row = run_job(job, seed, Path(tmp) / f"{job}-{seed}")
                total.update(row.kinds)
                kinds = ", ".join(f"{k}x{n}" for k, n in sorted(row.kinds.items())) or "-"
                print(
                    f"{row.job:<10} {row.seed:>4} {row.steps:>6} {row.events:>6} "
                    f"{row.decisions:>9} {row.wall_s:>7.1f}  {kinds}",
                    flush=True,
                )
    print(f"events by kind over all runs: {dict(total) or 'none'}")


if __name__ == "__main__":
    main()
