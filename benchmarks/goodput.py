"""Goodput under faults: no supervisor, a Ray Train restart, and remedy, on one job and schedule.

The same 4-rank DDP job (the GPT of examples/gpt_model.py, gloo on CPU) and
the same seeded schedule of faults (a NaN loss, poisoned batches, an OOM,
a hung rank, a killed rank, a killed supervisor), injected
by remedy's own `FaultInjector` at the same steps and ranks, run three ways
in one invocation:

(a) no supervisor: the plain loop under torch.distributed, collective
    timeout 60 s; it trains on through a NaN (its weights are then NaN:
    nothing after is kept) and dies at the first fault it cannot survive;
(b) a real Ray Train `TorchTrainer` (`FailureConfig(max_failures=-1)`,
    `TorchConfig(timeout_s=60)`), a checkpoint through `ray.train.report`
    every `--checkpoint-every` steps; a non-finite loss raises, and any
    failure restarts the whole group from the last checkpoint. Its killed
    "supervisor" is the TrainController actor: the run dies with it, and the
    script starts it again with the same name and storage, as an operator
    would, resuming from the last checkpoint;
(c) remedy: `examples/pretrain_gpt.py` under `remedy run` with
    src/remedy/policies/llm-pretrain.yaml.

For each: step goodput (steps kept / executed), ETTR (seconds of kept
steps / wall seconds), the seconds and steps lost per fault kind, and the
final loss (mean of rank 0's last 10 training losses) against the fault-free
plain loop's. (a) and (b) are measured from rank 0's step records with the
ledger remedy's summaries use (`supervisor.core.goodput`), each rewind and
stall charged to the fault that fired before it; (c) from its summary.

Then a labelled projection: ETTR of (b) and (c) at the Llama 3 interruption
rate (419 unexpected interruptions in 54 days of a 16k-GPU job) and cause
mix, from the per-kind costs measured here, at `--step-s` seconds per step and
a checkpoint every `--checkpoint-min` minutes (default 10 s and 30 min).

    python benchmarks/goodput.py [--steps 200] [--seed 3] [--modes abc] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._smoke import add_check_imports, check_imports  # noqa: E402
from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, cosine_with_warmup, lm_loss  # noqa: E402
from remedy.control.goodput import GoodputLedger  # noqa: E402
from remedy.rank.chaos.faults import Fault, FaultInjector  # noqa: E402

WORLD = 4
COLLECTIVE_TIMEOUT_S = 60
# The job: small enough that a run of the whole schedule fits in minutes on 2 cores.
JOB = {"layers": 1, "width": 32, "block": 32, "batch": 8, "lr": 3e-3, "warmup": 30}
EXAMPLE_ARGS = ["--layers", "1", "--width", "32", "--block-size", "32", "--batch-size", "8",
                "--sample-every", "0", "--snapshot-every", "5"]  # fmt: skip
# The schedule's kinds, in the order slots are drawn for them.
KINDS = ("nan_loss", "loss_spike", "oom", "hang_rank", "kill_rank", "kill_supervisor")
# What kills a plain loop (a): a raise in one rank, a dead or stopped one.
FATAL = {"oom", "hang_rank", "kill_rank"}
FINAL_LOSS_STEPS = 10

# Llama 3 (arXiv 2407.21783, Table 5): the 419 unexpected interruptions of a 54-day
# snapshot of pre-training on 16,384 H100 GPUs, by root cause, as counted here, and
# the fault each is charged as: a rank lost (its process or node dies), a collective
# that hangs, or wrong numbers (silent data corruption shows as a numeric fault).
LLAMA3_DAYS = 54
LLAMA3_CAUSES: dict[str, tuple[int, str]] = {
    "faulty GPU": (148, "kill_rank"),
    "GPU HBM3 memory": (72, "kill_rank"),
    "software bug": (54, "kill_rank"),
    "network switch/cable": (35, "hang_rank"),
    "host maintenance": (32, "kill_rank"),
    "GPU SRAM memory": (19, "kill_rank"),
    "GPU system processor": (17, "kill_rank"),
    "NIC": (7, "kill_rank"),
    "NCCL watchdog timeouts": (7, "hang_rank"),
    "silent data corruption": (6, "nan_loss"),
    "GPU thermal interface and sensor": (6, "kill_rank"),
    "SSD": (3, "kill_rank"),
    "power supply": (3, "kill_rank"),
    "server chassis": (2, "kill_rank"),
    "IO expansion board": (2, "kill_rank"),
    "dependency": (2, "kill_rank"),
    "CPU": (2, "kill_rank"),
    "system memory": (2, "kill_rank"),
}


def schedule(steps: int, seed: int) -> list[Fault]:
    """One fault of each kind, in a seeded order, on slots spread over the middle of the run.

    Slots are at least 20 steps apart and the hang and the kill hit different ranks: the
    llm-pretrain policy cools a rank's restarts down for 20 steps, which at a real step
    time is minutes, not the second it is here.
    """
    rng = random.Random(seed)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    first, last = 20, steps - 20
    gap = (last - first) // len(kinds)
    faults: list[Fault] = []
    lost_ranks: set[int] = set()
    for i, kind in enumerate(kinds):
        step = first + i * gap + rng.randrange(max(gap - 20, 1))
        rank = rng.randrange(WORLD)
        if kind in ("hang_rank", "kill_rank"):
            while rank in lost_ranks:
                rank = (rank + 1) % WORLD
            lost_ranks.add(rank)
        extra: dict[str, Any] = {"duration": 3, "factor": 20.0} if kind == "loss_spike" else {}
        faults.append(Fault(kind=kind, at_step=step, rank=rank, **extra))  # type: ignore[arg-type]
    return faults


# ------------------------------------------------------------------ the job
def build(rank: int, world: int, steps: int) -> tuple[Any, Any, Any, SyntheticCorpus]:
    """The example's model, optimizer, schedule and data (examples/pretrain_gpt.py)."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=JOB["block"], n_layer=JOB["layers"], n_embd=JOB["width"])
    model: torch.nn.Module = GPT(cfg)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=JOB["lr"], weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(JOB["warmup"], steps))
    corpus = SyntheticCorpus(block_size=JOB["block"], batch_size=JOB["batch"], seed=0)
    return model, opt, sched, corpus


def train_step(
    model: Any, opt: Any, sched: Any, corpus: SyntheticCorpus, injector: FaultInjector,
    step: int, rank: int, world: int, *, raise_on_nan: bool,
) -> tuple[float, bool]:  # fmt: skip
    """One step with the faults due; (loss, whether the update was garbage)."""
    injector.before_step(step)
    batch = corpus.batch(step * world + rank)
    loss = injector.on_loss(step, step, lm_loss(model, batch))
    if raise_on_nan and not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss at step {step}")
    loss.backward()
    injector.on_grads(step, [p for p in model.parameters() if p.requires_grad])
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    value = float(loss.detach())
    garbage = not math.isfinite(value) or not all(
        torch.isfinite(p).all() for p in model.parameters()
    )
    return value, garbage


class Records:
    """Rank 0's step records (JSON lines), as remedy's metrics.jsonl has them."""

    def __init__(self, path: Path) -> None:
        self.fh = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the loop

    def write(self, step: int, tick: int, seconds: float, loss: float, skipped: bool) -> None:
        loss_text = loss if math.isfinite(loss) else str(loss)
        self.fh.write(json.dumps({"rank": 0, "step": step, "tick": tick, "step_time_s": seconds,
                                  "t_end": time.time(), "loss": loss_text,
                                  "optimizer_skipped": skipped}) + "\n")  # fmt: skip


# ------------------------------------------------------------------ (a) plain loop
def plain_rank(rank: int, work: str, steps: int, faults: list[dict[str, Any]], port: int) -> None:
    """One rank of the plain loop: no supervisor, nothing catches anything."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=__import__("datetime").timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )  # fmt: skip
    model, opt, sched, corpus = build(rank, WORLD, steps)
    injector = FaultInjector([Fault(**f) for f in faults], rank, run_dir=work)
    records = Records(Path(work) / "steps.jsonl") if rank == 0 else None
    for step in range(steps):
        t0 = time.perf_counter()
        loss, garbage = train_step(model, opt, sched, corpus, injector, step, rank, WORLD,
                                   raise_on_nan=False)  # fmt: skip
        if records is not None:
            records.write(step, step, time.perf_counter() - t0, loss, garbage)
    dist.destroy_process_group()


def run_plain(work: Path, steps: int, faults: list[Fault]) -> dict[str, Any]:
    """(a): four processes; the job ends when every rank has ended (or is stuck for good)."""
    import torch.multiprocessing as mp  # noqa: PLC0415

    work.mkdir(parents=True)
    port = _free_port()
    dumped = [f.model_dump(exclude={"source"}) for f in faults if f.kind != "kill_supervisor"]
    t0 = time.time()
    # Forked, so the ranks start without importing torch again (this process has run no
    # torch op and started no Ray yet).
    ctx = mp.start_processes(plain_rank, args=(str(work), steps, dumped, port), nprocs=WORLD,
                             join=False, start_method="fork")  # fmt: skip
    procs = ctx.processes
    died_at = None
    while any(p.is_alive() for p in procs):
        ended = [p for p in procs if not p.is_alive()]
        if ended and died_at is None and any(p.exitcode != 0 for p in ended):
            died_at = time.time()
        # A stopped (hung) rank never ends: once its peers are gone, the job is dead.
        alive = [p for p in procs if p.is_alive()]
        if ended and all(_stopped(p.pid) for p in alive):
            break
        if time.time() - t0 > steps * 5 + 4 * COLLECTIVE_TIMEOUT_S:
            break
        time.sleep(0.2)
    ended_at = time.time()
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    completed = all(p.exitcode == 0 for p in procs)
    return account(work, t0, ended_at, steps, faults, completed=completed)


def _stopped(pid: int | None) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("T")
    except (OSError, IndexError):
        return True


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ (b) Ray Train
def ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's worker loop: resume from the last checkpoint, checkpoint every N steps."""
    import ray.train  # noqa: PLC0415

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    steps, every = config["steps"], config["checkpoint_every"]
    model, opt, sched, corpus = build(rank, world, steps)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["step"]
    injector = FaultInjector([Fault(**f) for f in config["faults"]], rank,
                             run_dir=config["work"], kill_supervisor=_kill_train_controller)  # fmt: skip
    records = Records(Path(config["work"]) / "steps.jsonl") if rank == 0 else None
    for tick, step in enumerate(range(start, steps)):
        t0 = time.perf_counter()
        loss, garbage = train_step(model, opt, sched, corpus, injector, step, rank, world,
                                   raise_on_nan=True)  # fmt: skip
        if records is not None:
            records.write(step, tick, time.perf_counter() - t0, loss, garbage)
        if (step + 1) % every == 0 or step + 1 == steps:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step + 1},
                               Path(d) / "state.pt")  # fmt: skip
                ray.train.report(
                    {"step": step + 1, "loss": loss},
                    checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None,
                )


def _kill_train_controller() -> None:
    """Ray Train's supervisor, its TrainController actor, killed (SIGKILL) like remedy's: found
    by the title Ray gives its process (`ray::TrainController...`) on this node."""
    for proc in Path("/proc").iterdir():
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"ray::TrainController"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def run_ray_train(work: Path, steps: int, faults: list[Fault], every: int) -> dict[str, Any]:
    """(b): TorchTrainer with unlimited group restarts; a dead controller is started again."""
    import ray  # noqa: PLC0415
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: PLC0415
    from ray.train.torch import TorchConfig, TorchTrainer  # noqa: PLC0415

    work.mkdir(parents=True)
    config = {"steps": steps, "checkpoint_every": every, "work": str(work),
              "faults": [f.model_dump(exclude={"source"}) for f in faults]}  # fmt: skip
    t0 = time.time()
    launches = 0
    while True:
        launches += 1
        trainer = TorchTrainer(
            ray_train_loop, train_loop_config=config,
            torch_config=TorchConfig(backend="gloo", timeout_s=COLLECTIVE_TIMEOUT_S),
            scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False,
                                         resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(name="goodput-b", storage_path=str(work / "storage"),
                                 failure_config=FailureConfig(max_failures=-1),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
        )  # fmt: skip
        try:
            trainer.fit()
            break
        except Exception as exc:  # the controller died: the operator starts the run again
            if launches >= 5:
                raise
            print(f"  (b) run ended by {type(exc).__name__}; started again", file=sys.stderr)
            with contextlib.suppress(Exception):
                ray.util.state.list_actors()  # let the dead controller's state settle
    return account(work, t0, time.time(), steps, faults, completed=True, launches=launches)


# ------------------------------------------------------------------ (c) remedy
def run_remedy(work: Path, steps: int, faults: list[Fault], every: int) -> dict[str, Any]:
    from remedy.cli.runner import run_supervised  # noqa: PLC0415
    from remedy.protocol.spec import RunSpec  # noqa: PLC0415

    spec = RunSpec(
        target=f"{REPO / 'examples' / 'pretrain_gpt.py'}:main", policy="llm-pretrain",
        workers=WORLD, run_dir=str(work), faults=[f.model_dump() for f in faults],
        argv=[*EXAMPLE_ARGS, "--steps", str(steps), "--checkpoint-every", str(every)],
        threads_per_rank=1,
    )  # fmt: skip
    t0 = time.time()
    summary = run_supervised(spec)
    print(f"  (c) {summary['status']}: anomalies {summary.get('anomalies')}, actions "
          f"{summary.get('actions')}{', ' + str(summary.get('abort_reason')) if summary.get('abort_reason') else ''}",
          file=sys.stderr)  # fmt: skip
    fired = _fired(work)
    first_seen = _first_seen(work / "anomalies.jsonl")
    by_kind: dict[str, dict[str, float]] = {}
    for r in summary.get("time_lost") or []:
        kind = _fault_of(r.get("cause"), fired, first_seen, faults)
        if kind is None and r.get("cause") == "unattributed":
            kind = "unattributed"
        if kind is not None:
            entry = by_kind.setdefault(kind, {"seconds": 0.0, "steps": 0})
            entry["seconds"] += r["seconds"]
            entry["steps"] += r["steps"]
    for outage in summary.get("supervisor_downtime") or []:
        by_kind.setdefault("kill_supervisor", {"seconds": 0.0, "steps": 0})
        by_kind["kill_supervisor"]["outage_s"] = outage["down_s"]
    startup = sum(r["seconds"] for r in summary["time_lost"] if r["what"] == "startup")
    return {
        "completed": summary["status"] == "completed", "steps_completed": summary["steps_completed"],
        "steps_executed": summary["steps_executed"], "steps_kept": summary["steps_kept"],
        "goodput": summary["goodput"], "ettr": summary["ettr"], "wall_s": time.time() - t0,
        "ettr_after_start": summary["time_kept_s"] / (summary["wall_s"] - startup),
        "final_loss": summary["final_loss"], "lost": by_kind,
    }  # fmt: skip


def _first_seen(path: Path) -> dict[str, int]:
    """Anomaly kind -> the step it was first seen at."""
    out: dict[str, int] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        rec = json.loads(line)
        out.setdefault(rec["kind"], int(rec["step"]))
    return out


def _fault_of(
    cause: Any, fired: dict[str, float], first_seen: dict[str, int], faults: list[Fault]
) -> str | None:
    """The fault behind a lost-time row's cause (an anomaly kind): the scheduled fault that
    fired last at or before the step the anomaly was first seen at (a hung rank is seen at its
    last step, one before the fault's). A replay's classification or a rank loss is charged to
    the fault it followed, whichever kind of fault that was."""
    if cause == "supervisor_restart":
        return "kill_supervisor"
    step = first_seen.get(cause)
    if step is None:
        return None
    before = [f for f in faults if f.kind in fired and f.at_step <= step + 1]
    return max(before, key=lambda f: f.at_step).kind if before else None


# ------------------------------------------------------------------ accounting
def _fired(work: Path) -> dict[str, float]:
    """Fault kind -> when it fired (its marker in the run directory)."""
    out: dict[str, float] = {}
    for marker in (work / "chaos" / "fired").glob("*.json"):
        kind = json.loads(marker.read_text()).get("kind")
        out[kind] = min(out.get(kind, math.inf), marker.stat().st_mtime)
    return out


def account(
    work: Path, t0: float, t1: float, steps: int, faults: list[Fault], *, completed: bool,
    launches: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Replay rank 0's records through remedy's ledger, every rewind and stall charged to the
    fault that fired last before it."""
    fired = _fired(work)
    ledger = GoodputLedger()
    for kind, at in fired.items():
        ledger.disrupted(at, kind)
        if kind != "loss_spike":  # poisoned data rewinds nothing by itself
            ledger.expect_rewind(at, kind)
    records = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
    numeric = sorted((at, k) for k, at in fired.items() if k in ("nan_loss", "nan_grad"))
    for rec in records:
        ledger.record(0, rec)
        if rec["optimizer_skipped"]:  # garbage since the first NaN fired before it
            before = [k for at, k in numeric if at <= rec["t_end"]]
            if before:
                ledger.event(rec["step"], before[0])
    done = ledger.steps if not completed else steps
    summary = ledger.summary(started=t0, ended=t1, completed=done)
    lost: dict[str, dict[str, float]] = {}
    for r in summary["time_lost"]:
        if r["cause"] in KINDS:
            entry = lost.setdefault(r["cause"], {"seconds": 0.0, "steps": 0})
            entry["seconds"] += r["seconds"]
            entry["steps"] += r["steps"]
    kept_losses = [float(r["loss"]) for r in records[-FINAL_LOSS_STEPS:]
                   if isinstance(r["loss"], float)]  # fmt: skip
    if not completed:
        # The job died of its first fatal fault: the wait for the dead job, and every step
        # it never ran, are that fault's.
        first_fatal = min((f for f in faults if f.kind in FATAL), key=lambda f: f.at_step)
        entry = lost.setdefault(first_fatal.kind, {"seconds": 0.0, "steps": 0})
        entry["seconds"] += t1 - (ledger.last_end or t1)
        entry["never_run"] = steps - ledger.steps
    first = ledger.first_start or t0
    return {
        "completed": completed, "steps_completed": ledger.steps, "launches": launches,
        "steps_executed": summary["steps_executed"], "steps_kept": summary["steps_kept"],
        "goodput": summary["goodput"], "ettr": summary["ettr"], "wall_s": t1 - t0,
        "ettr_after_start": summary["time_kept_s"] / (t1 - first) if t1 > first else None,
        "final_loss": statistics.mean(kept_losses) if kept_losses else math.nan,
        "lost": lost,
    }  # fmt: skip


# ------------------------------------------------------------------ projection
@dataclass
class Costs:
    """Per fault kind: fixed seconds lost per interruption, and steps redone."""

    seconds: dict[str, float]
    steps: dict[str, float]


def project(costs: Costs, *, step_s: float, checkpoint_s: float, full_restart: bool) -> float:
    """ETTR at the Llama 3 rate and mix: 1 - (interruptions per second) x (seconds each costs).

    Each interruption costs its kind's measured fixed seconds (detection, restart), plus what
    scales with the step time: the step in flight when a rank is lost; a full-group restart
    from a checkpoint (b) redoes half a checkpoint interval on average; remedy (c) redoes
    the steps it measured, and finds a hang after `step_multiple` step times (its hang
    watch's timeout, measured here at a 50 ms step).
    """
    from remedy.control.hang_watch import HangWatchConfig  # noqa: PLC0415

    total = sum(n for n, _ in LLAMA3_CAUSES.values())
    rate = total / (LLAMA3_DAYS * 86400)
    cost = 0.0
    for count, kind in LLAMA3_CAUSES.values():
        redo = checkpoint_s / 2 if full_restart else costs.steps.get(kind, 0.0) * step_s
        in_flight = step_s if kind in ("kill_rank", "hang_rank") else 0.0
        watch = (
            HangWatchConfig().step_multiple * step_s
            if kind == "hang_rank" and not full_restart
            else 0.0
        )
        cost += count / total * (costs.seconds.get(kind, 0.0) + redo + in_flight + watch)
    return max(0.0, 1 - rate * cost)


def fixed_costs(result: dict[str, Any], step_s_measured: float) -> Costs:
    """The measured time lost per kind minus its redone steps' time (which the projection
    rescales to the real step time), and the steps redone."""
    seconds, steps = {}, {}
    for kind, lost in result["lost"].items():
        steps[kind] = float(lost.get("steps", 0))
        seconds[kind] = max(float(lost["seconds"]) - steps[kind] * step_s_measured, 0.0)
    return Costs(seconds, steps)


# ------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--modes", default="abc", help="a (no supervisor), b (Ray Train), c (remedy)")
    p.add_argument("--step-s", type=float, default=10.0, help="step time of the projection")
    p.add_argument("--checkpoint-min", type=float, default=30.0, help="its checkpoint interval")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--keep", default=None, help="keep the runs' directories under this folder")
    add_check_imports(p)
    args = p.parse_args()
    if args.check_imports:
        check_imports(
            "ray",
            "ray.train",
            "ray.train.torch",
            "torch.multiprocessing",
            "remedy.cli.runner",
            "remedy.protocol.spec",
            "remedy.control.hang_watch",
            targets=(f"{REPO / 'examples' / 'pretrain_gpt.py'}:main",),
        )
        return
    faults = schedule(args.steps, args.seed)
    print("schedule: " + ", ".join(f"{f.kind}@{f.at_step} r{f.rank}" for f in faults))
    import ray  # noqa: PLC0415

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp_s:
        tmp = Path(args.keep) if args.keep else Path(tmp_s)
        clean = run_plain(tmp / "clean", args.steps, [])
        step_s = statistics.median(
            json.loads(x)["step_time_s"]
            for x in (tmp / "clean" / "steps.jsonl").read_text().splitlines()
        )
        print(f"fault-free plain loop: {clean['wall_s']:.1f}s, final loss {clean['final_loss']:.4f}, "
              f"step {step_s * 1000:.0f} ms")  # fmt: skip
        if "a" in args.modes:
            results["(a) no supervisor"] = run_plain(tmp / "a", args.steps, faults)
        ray.init(num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, logging_level="ERROR",
                 _system_config={"kill_worker_timeout_milliseconds": 100})  # fmt: skip
        try:
            if "b" in args.modes:
                results["(b) Ray Train restart"] = run_ray_train(tmp / "b", args.steps, faults,
                                                                 args.checkpoint_every)  # fmt: skip
            if "c" in args.modes:
                results["(c) remedy"] = run_remedy(
                    tmp / "c", args.steps, faults, args.checkpoint_every
                )
        finally:
            ray.shutdown()
    report(results, clean, faults, step_s, args)


def report(results: dict[str, dict[str, Any]], clean: dict[str, Any], faults: list[Fault],
           step_s: float, args: argparse.Namespace) -> None:  # fmt: skip
    load = os.getloadavg()
    print(f"\n4 ranks, {args.steps} steps, checkpoint every {args.checkpoint_every} steps; "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")  # fmt: skip
    print("ETTR: seconds of kept steps / wall seconds; 'after start' leaves out the start-up")
    print(f"{'mode':<24} {'done':>5} {'executed':>9} {'kept':>5} {'goodput':>8} {'ETTR':>6} "
          f"{'after start':>12} {'wall s':>7} {'final loss':>11} {'vs clean':>9}")  # fmt: skip
    for name, r in results.items():
        loss = r["final_loss"] if r["final_loss"] is not None else math.nan
        delta = (loss - clean["final_loss"]) / clean["final_loss"]
        print(f"{name:<24} {'yes' if r['completed'] else 'NO':>5} {r['steps_executed']:>9} "
              f"{r['steps_kept']:>5} {r['goodput']:>8.1%} {(r['ettr'] or 0):>6.1%} "
              f"{(r['ettr_after_start'] or 0):>12.1%} {r['wall_s']:>7.1f} "
              f"{loss:>11.4f} {delta:>+9.1%}")  # fmt: skip
    print("\nseconds (steps) lost per fault kind:")
    print(f"{'fault':<18}" + "".join(f"{name:>26}" for name in results))
    # "unattributed": a rewind or stall that no anomaly announced (remedy's ledger only)
    for label in [*(f.kind for f in faults), "unattributed"]:
        cells = []
        for r in results.values():
            lost = r["lost"].get(label)
            if lost is None:
                cells.append("-")
                continue
            text = f"{lost['seconds']:.1f}s ({lost.get('steps', 0):.0f})"
            if "never_run" in lost:
                text += f", died: {lost['never_run']} never run"
            if "outage_s" in lost:
                text += f", down {lost['outage_s']:.1f}s"
            cells.append(text)
        print(f"{label:<18}" + "".join(f"{c:>26}" for c in cells))
    systems = ("hang_rank", "kill_rank", "kill_supervisor")
    b, c = results.get("(b) Ray Train restart"), results.get("(c) remedy")
    if b and c:
        for kind in systems:
            tb = b["lost"].get(kind, {}).get("seconds", 0.0)
            tc = c["lost"].get(kind, {}).get("seconds", 0.0)
            ratio = f"{tc / tb:.3f}" if tb else "-"
            print(f"{kind}: remedy lost {tc:.1f}s, Ray Train {tb:.1f}s: ratio {ratio}")
    total = sum(n for n, _ in LLAMA3_CAUSES.values())
    mix = ", ".join(f"{name} {n}" for name, (n, _) in LLAMA3_CAUSES.items())
    print(f"\nPROJECTION (not measured): Llama 3 rate, {total} interruptions in {LLAMA3_DAYS} days "
          f"({total / LLAMA3_DAYS / 24:.3f} per hour); causes: {mix}; charged as kill_rank, "
          f"hang_rank (network, NCCL timeouts) or nan_loss (silent data corruption); "
          f"step {args.step_s:g} s, checkpoint every {args.checkpoint_min:g} min")  # fmt: skip
    projected = {}
    for name, r in results.items():
        if name.startswith("(a)"):
            continue
        full = name.startswith("(b)")
        costs = fixed_costs(r, step_s)
        projected[name] = project(costs, step_s=args.step_s, checkpoint_s=args.checkpoint_min * 60,
                                  full_restart=full)  # fmt: skip
        print(f"{name:<24} projected ETTR {projected[name]:.2%}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"schedule": [f.model_dump(exclude={"source"}) for f in faults], "clean": clean,
             "results": results, "projected_ettr": projected, "load_average": load,
             "step_s_measured": step_s, "args": vars(args)}, indent=2, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
