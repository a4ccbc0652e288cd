"""The supervisor SIGKILLed at random moments of a run with a NaN and a hang: same end, same weights.

One run without a kill first (the twin), then `--kills` runs of the same job,
each with the supervisor's process SIGKILLed once at a moment drawn uniformly
from `--window` seconds after the run starts (seeded: `--seed`). The job is
tests/supervisor/daemon_train.py on `--workers` gloo ranks with one warm
spare: a NaN loss on rank 0 at step 60 (rolled back, the LR cut) and rank 1
hung (SIGSTOPped) at step 150 (replaced by the spare, the group re-formed
from rank 0's state). Ray restarts the supervisor, which resumes from its
journal wherever the kill fell: between two reports, in the middle of the
NaN's decision or the hang's restart.

For each kill, the table says the step rank 0 had reported when it fell, the
run's end, the supervisor restarts, the decisions (action, anomaly step,
outcome) and whether they are the twin's, whether any decision id was given
twice, and whether the final parameters are the twin's bit for bit (each
rank's digest). It exits 1 unless every run completed with the twin's
weights.

    python benchmarks/random_kills.py [--kills 10] [--seed 48] [--window 1 40] [--workers 2]
        [--clock run|training]

`--clock training` counts the moments from rank 0's first step instead of
the run's start: on a loaded machine starting the ranks alone takes tens of
seconds, and every kill would fall before training begins.

tests/supervisor/test_random_kills_e2e.py runs it with fewer kills (slow tier).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._smoke import add_check_imports, check_imports  # noqa: E402

TARGET = f"{REPO / 'tests' / 'supervisor' / 'daemon_train.py'}:main"
FAULTS = [
    {"kind": "nan_loss", "at_step": 60, "rank": 0},
    {"kind": "hang_rank", "at_step": 150, "rank": 1},
]


@dataclass
class KillRun:
    """One run and what became of it (`kill_at_s` None: the twin, no kill)."""

    kill_at_s: float | None
    status: str = ""
    killed: bool = False  # the kill was sent (False: the run ended before its moment)
    kill_step: int = -1  # the step rank 0 had reported when the kill was sent
    restarts: int = 0
    decisions: list[tuple[str, str, int, str]] = field(default_factory=list)
    ids_unique: bool = True
    digests: set[str] = field(default_factory=set)
    wall_s: float = 0.0
    error: str = ""

    def same_weights(self, twin: KillRun) -> bool:
        return len(self.digests) == 1 and self.digests == twin.digests


def _reported_step(run_dir: Path) -> int:
    """The highest step rank 0 has reported so far (-1: none)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()[-40:]
    except OSError:
        return -1
    steps = [
        int(json.loads(line).get("step", -1))
        for line in lines
        if line.endswith("}") and '"rank": 0' in line
    ]
    return max(steps, default=-1)


def _kill_at(
    run_id: str, run_dir: Path, at_s: float, t0: float, out: KillRun, *, clock: str = "run"
) -> None:
    """SIGKILL the run's supervisor process `at_s` seconds after `t0` (the run's start), or,
    with `clock` "training", after rank 0's first step was reported."""
    import ray  # noqa: PLC0415 - the driver's Ray, started by main or the test

    from remedy.protocol.spec import NAMESPACE, supervisor_name  # noqa: PLC0415

    if clock == "training":  # on a loaded machine the ranks' start alone can take 40 s
        while _reported_step(run_dir) < 0 and not (run_dir / "summary.json").exists():
            time.sleep(0.05)
        t0 = time.time()
    time.sleep(max(0.0, t0 + at_s - time.time()))
    deadline = time.time() + 60
    while time.time() < deadline and not (run_dir / "summary.json").exists():
        try:
            sup = ray.get_actor(supervisor_name(run_id), namespace=NAMESPACE)
            # Its process (answered from its control group, however busy its loop is).
            pid = ray.get(sup.where.remote(), timeout=30)[1]
        except (ValueError, ray.exceptions.RayError):  # not created yet, or restarting
            time.sleep(0.1)
            continue
        out.kill_step = _reported_step(run_dir)
        os.kill(pid, signal.SIGKILL)
        out.killed = True
        return


def one_run(
    tmp: Path, kill_at_s: float | None, workers: int = 2, steps: int = 400, clock: str = "run"
) -> KillRun:
    """The job under `remedy run` (this process's Ray), the supervisor killed at `kill_at_s`
    (seconds from the run's start, or with `clock` "training" from rank 0's first step)."""
    from remedy.cli.runner import run_supervised  # noqa: PLC0415 - Ray-side imports
    from remedy.protocol.spec import RunSpec  # noqa: PLC0415
    from remedy.rundir.writer import read_jsonl  # noqa: PLC0415

    argv = ["--steps", str(steps), "--step-s", "0.1"]
    spec = RunSpec(
        target=TARGET, workers=workers, run_dir=str(tmp), faults=FAULTS, argv=argv,
        threads_per_rank=1, spares=1,
    )  # fmt: skip
    out = KillRun(kill_at_s)
    t0 = time.time()
    killer = None
    if kill_at_s is not None:
        killer = threading.Thread(
            target=_kill_at,
            args=(spec.run_id, tmp, kill_at_s, t0, out),
            kwargs={"clock": clock},
            daemon=True,
        )
        killer.start()
    try:
        summary = run_supervised(spec)
    except Exception as exc:  # a failed run is a row of the table, not the end of it
        out.error = f"{type(exc).__name__}: {exc}"[:200]
        return out
    finally:
        out.wall_s = time.time() - t0
        if killer is not None:
            killer.join(timeout=5)
    out.status = summary["status"]
    out.restarts = int(summary.get("supervisor_restarts") or 0)
    records = read_jsonl(tmp / "decisions.jsonl")
    ids = [d["decision_id"] for d in records]
    out.ids_unique = len(ids) == len(set(ids))
    out.decisions = sorted(
        (d["action"], d["anomaly"]["kind"], int(d["anomaly"]["step"]), d["outcome"])
        for d in records
    )
    out.digests = {str(r["result"]["params_digest"]) for r in summary["ranks"]}
    return out


def kill_times(kills: int, seed: int, window: tuple[float, float]) -> list[float]:
    """`kills` moments drawn uniformly from `window` (seconds after the run starts), seeded."""
    rng = random.Random(seed)
    return [round(rng.uniform(*window), 1) for _ in range(kills)]


def _decisions(r: KillRun) -> str:
    return ", ".join(f"{a}@{s} {o}" for a, _, s, o in r.decisions)


HEADER = (
    f"{'#':>3} {'kill at s':>9} {'at step':>7} {'end':>10} {'restarts':>8} "
    f"{'decisions as twin':>17} {'ids unique':>10} {'weights as twin':>15} {'wall s':>7}"
)


def row(i: int, r: KillRun, twin: KillRun) -> list[str]:
    """One kill's line of the table (and its error or its decisions, where they differ)."""
    kill_at = r.kill_at_s if r.kill_at_s is not None else 0.0
    line = (
        f"{i:>3} {kill_at:>9.1f} {r.kill_step if r.killed else 'ended':>7} "
        f"{r.status or 'error':>10} {r.restarts:>8} {r.decisions == twin.decisions!s:>17} "
        f"{r.ids_unique!s:>10} {r.same_weights(twin)!s:>15} {r.wall_s:>7.1f}"
    )
    lines = [line]
    if r.error:
        lines.append(f"    error: {r.error}")
    elif r.decisions != twin.decisions:
        lines.append(f"    decisions: {_decisions(r)}")
    return lines


def table(twin: KillRun, runs: list[KillRun]) -> list[str]:
    """The printed table: the twin, one line per kill, then the tally."""
    lines = [f"twin (no kill): {twin.status}, {twin.wall_s:.1f} s, decisions {_decisions(twin)}"]
    lines.append(HEADER)
    for i, r in enumerate(runs, 1):
        lines.extend(row(i, r, twin))
    good = sum(1 for r in runs if r.status == "completed" and r.same_weights(twin))
    killed = sum(1 for r in runs if r.killed)
    lines.append(
        f"{good} of {len(runs)} completed with the twin's weights ({killed} kills landed "
        f"before the run ended)"
    )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--seed", type=int, default=48)
    p.add_argument("--window", type=float, nargs=2, default=(1.0, 40.0), metavar=("FROM", "TO"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument(
        "--clock",
        choices=("run", "training"),
        default="run",
        help="kill moments count from the run's start, or from rank 0's first step",
    )
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports(
            "ray", "remedy.cli.runner", "remedy.protocol.spec", "remedy.rundir.writer",
            targets=(TARGET,),
        )  # fmt: skip
        return
    import ray  # noqa: PLC0415 - not needed by --check-imports' parse

    ray.init(
        num_cpus=args.workers + 2, include_dashboard=False, _node_ip_address="127.0.0.1",
        log_to_driver=False, logging_level="ERROR",
        _system_config={"kill_worker_timeout_milliseconds": 100},
    )  # fmt: skip
    times = kill_times(args.kills, args.seed, tuple(args.window))
    print(f"{args.workers} ranks + 1 spare, {args.steps} steps of 0.1 s; faults {FAULTS}")
    since = "the run's start" if args.clock == "run" else "rank 0's first step"
    print(
        f"kill moments (seed {args.seed}, {args.window[0]}-{args.window[1]} s after {since}): "
        f"{times}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        twin = one_run(Path(tmp) / "twin", None, args.workers, args.steps)
        print(f"twin (no kill): {twin.status}, {twin.wall_s:.1f} s\n{HEADER}", flush=True)
        runs = []
        for i, at_s in enumerate(times, 1):
            runs.append(one_run(Path(tmp) / f"kill{i}", at_s, args.workers, args.steps, args.clock))
            print("\n".join(row(i, runs[-1], twin)), flush=True)
    ray.shutdown()
    print()
    print("\n".join(table(twin, runs)))
    ok = twin.status == "completed" and all(
        r.status == "completed" and r.same_weights(twin) and r.ids_unique for r in runs
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
