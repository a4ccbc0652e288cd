"""How many steps after a fault its anomaly is reported, and how many false alarms a clean run raises.

Each scenario trains the example GPT in single-process mode under a Guard
with every default detector and an observe-only policy (anomalies are
logged, nothing is rolled back, so the run stays the run that was asked
for). The fault enters at step 300: a chaos fault through
`WorkerContext(faults=[...])` where one exists (nan_loss, nan_grad,
loss_spike, grad_explosion, memory_leak, slow_loader, oom), otherwise a
real cause built into the run (a real fp16 GradScaler pushed into an
overflow storm, a learning rate blown up tenfold or cut to zero, a garbage
data source, a loader stuck on a few batches, padded batches). The latency
is the step of the first event of the expected kind minus 300. Every event
the Guard reports is counted, those of the faulty run's other kinds too.

Then the clean baseline: the tiny example for 2000 steps with warm-up and
cosine LR, and the number of events it raises (the goal is zero).

    python benchmarks/detection_latency.py [--skip-clean] [--skip-frameworks | --only-frameworks]

The framework rows run the HF and Lightning examples under their callbacks
(accumulation 2, clipping; Lightning in bf16) with the fault at step 60 and
the default policy.

About two minutes on two shared CPU cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
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
from remedy.rank import Fault, Guard, GuardConfig, WorkerContext  # noqa: E402
from remedy.rank.detectors import default_detectors  # noqa: E402
from remedy.rank.detectors.testing import observe_only_policy  # noqa: E402

AT = 300  # every fault starts here
TINY = GPTConfig(n_layer=2, n_embd=64, block_size=32)
FP16 = GPTConfig(n_layer=1, n_embd=32, block_size=16)  # fp16 autocast on CPU is slow: smaller


@dataclass
class Scenario:
    fault: str
    expect: str
    steps: int
    goal: str
    faults: list[Fault] = field(default_factory=list)
    lr_factor: Callable[[int], float] | None = None
    data: Callable[[SyntheticCorpus], Callable[[int], Any]] | None = None
    fp16_storm: bool = False


def garbage_every_other(corpus: SyntheticCorpus) -> Callable[[int], Any]:
    gen = torch.Generator().manual_seed(1)
    junk = [torch.randint(0, 64, (8, 33), generator=gen) for _ in range(64)]
    return lambda i: junk[i % 64] if i >= AT and i % 2 else corpus.batch(i)


def stuck_loader(corpus: SyntheticCorpus) -> Callable[[int], Any]:
    return lambda i: corpus.batch(i if i < AT else AT + i % 6)


def padded(corpus: SyntheticCorpus) -> Callable[[int], Any]:
    def batch(i: int) -> dict[str, torch.Tensor]:
        ids = corpus.batch(i)
        mask = torch.ones_like(ids)
        if i >= AT:
            mask[:, 8:] = 0  # 25 of each row's 33 tokens (76%) are padding
        return {"input_ids": ids, "attention_mask": mask}

    return batch


SCENARIOS = [
    Scenario("nan_loss", "nonfinite_loss", 310, "0", [Fault(kind="nan_loss", at_step=AT)]),
    Scenario("nan_grad", "nonfinite_grad", 310, "0", [Fault(kind="nan_grad", at_step=AT)]),
    Scenario("loss_spike (x10)", "loss_spike", 310, "0", [Fault(kind="loss_spike", at_step=AT, factor=10)]),
    Scenario("grad_explosion (x1e6)", "grad_norm_explosion", 310, "0", [Fault(kind="grad_explosion", at_step=AT)]),
    Scenario("oom", "oom", 310, "0", [Fault(kind="oom", at_step=AT)]),
    Scenario("slow_loader (0.1 s)", "data_stall", 320, "≤ 4 (window 5)",
             [Fault(kind="slow_loader", at_step=AT, seconds=0.1, duration=10)]),
    Scenario("memory_leak (4 MiB/step)", "memory_growth", 460, "≤ 120 (window 100)",
             [Fault(kind="memory_leak", at_step=AT, bytes=4 << 20, duration=150)]),
    Scenario("fp16 scaler storm", "scaler_overflow", 380, "≤ 60 (26 skips in 100)", fp16_storm=True),
    Scenario("LR x10 (divergence)", "loss_divergence", 560, "≤ 200 (window)",
             lr_factor=lambda s: 10.0 if s >= AT - 1 else 1.0),
    Scenario("garbage source (oscillation)", "loss_oscillation", 560, "≤ 240 (window + 2 blocks)",
             data=garbage_every_other),
    Scenario("LR → 0 (update stall)", "update_stall", 400, "≤ 70 (5 reads of 10)",
             lr_factor=lambda s: 0.0 if s >= AT - 1 else 1.0),
    Scenario("stuck loader (duplicates)", "duplicate_samples", 420, "≤ 100 (8 of 20 samples)",
             data=stuck_loader),
    Scenario("padded batches", "padding_ratio", 310, "0", data=padded),
]  # fmt: skip


def guarded_run(
    cfg: GPTConfig,
    steps: int,
    policy: Path,
    *,
    faults: list[Fault] | None = None,
    lr_factor: Callable[[int], float] | None = None,
    data: Callable[[SyntheticCorpus], Callable[[int], Any]] | None = None,
    fp16_storm: bool = False,
) -> list[dict[str, Any]]:
    """Train under a Guard; return every event the Guard reported."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor or cosine_with_warmup(30, steps))
    corpus = SyntheticCorpus(block_size=cfg.block_size, batch_size=8)
    scaler = torch.amp.GradScaler("cpu") if fp16_storm else None

    def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return lm_loss(m, b["input_ids"] if isinstance(b, dict) else b)

    guard = Guard(
        model,
        opt,
        loss_fn=loss_fn,
        data=data(corpus) if data else corpus.batch,
        scheduler=sched,
        scaler=scaler,
        max_steps=steps,
        config=GuardConfig(
            detectors=default_detectors(model),
            policy=str(policy),
            oom_wait_s=0.05,
            amp_dtype=torch.float16 if fp16_storm else None,
        ),
        context=WorkerContext(faults=faults or []),
    )
    events: list[dict[str, Any]] = []
    send = guard.reporter.send

    def capture(batch: dict[str, Any], *, wait: bool = False) -> None:
        events.extend(batch["events"])
        send(batch, wait=wait)

    guard.reporter.send = capture  # type: ignore[method-assign]
    for batch in guard:
        if scaler is not None and guard.step_count == AT:
            # A storm: the scale is thrown far too high and grows back every step.
            scaler.update(new_scale=torch.tensor(2.0**40))
            scaler.set_growth_interval(1)
        guard.step(batch)
    guard.close()
    return events


# Under the framework callbacks (remedy.integrations): the bundled examples' loops with
# accumulation 2 and clipping (Lightning also bf16), the fault at FRAMEWORK_AT.
FRAMEWORK_AT = 60
FRAMEWORK_SCENARIOS: list[tuple[str, str, str]] = [
    ("lightning", "nan_loss", "nonfinite_loss"),
    ("lightning", "grad_explosion", "grad_norm_explosion"),
    ("hf", "nan_loss", "nonfinite_loss"),
    ("hf", "grad_explosion", "grad_norm_explosion"),
]


def framework_run(loop: str, fault: str, policy: Path) -> list[dict[str, Any]]:
    """One example loop under its callback with one chaos fault; every anomaly it logged."""
    from remedy.rank.link.context import set_context  # noqa: PLC0415
    from remedy.rank.loop.target import load_target  # noqa: PLC0415 - needs the extras
    from remedy.rundir.writer import read_jsonl  # noqa: PLC0415

    run_dir = Path(tempfile.mkdtemp(prefix=f"remedy-latency-{loop}-"))
    target, extra = {
        "hf": ("examples/hf_trainer.py:main", ["--grad-accum", "2"]),
        "lightning": (
            "examples/lightning_module.py:main",
            ["--accumulate", "2", "--precision", "bf16-mixed"],
        ),
    }[loop]
    steps = FRAMEWORK_AT + 10
    set_context(WorkerContext(run_dir=run_dir, faults=[Fault(kind=fault, at_step=FRAMEWORK_AT)]))
    try:
        main_fn = load_target(str(ROOT / target))
        argv = ["--steps", str(steps), "--nan-at", "0", "--run-dir", str(run_dir), *extra]
        main_fn(argv)
    finally:
        set_context(None)
    del policy  # the examples run the default policy: latency is the anomaly's step
    return read_jsonl(run_dir / "anomalies.jsonl")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-clean", action="store_true", help="skip the 2000-step clean baseline")
    p.add_argument("--skip-frameworks", action="store_true", help="skip the callback rows")
    p.add_argument("--only-frameworks", action="store_true", help="only the callback rows")
    p.add_argument("--threads", type=int, default=1)
    add_check_imports(p)
    args = p.parse_args(argv)
    if args.check_imports:
        check_imports(
            "remedy.rank.link.context",
            "remedy.rank.loop.target",
            "remedy.rundir.writer",
            targets=("examples/hf_trainer.py:main", "examples/lightning_module.py:main"),
        )
        return
    torch.set_num_threads(args.threads)
    policy = observe_only_policy(tempfile.mkdtemp(prefix="remedy-latency-"))
    t0 = time.perf_counter()
    header = (
        f"{'fault (at step 300)':30} {'expected anomaly':20} {'first at':>8} {'latency':>7}  goal"
    )
    print(header + f"  {'other events':s}\n" + "-" * (len(header) + 14))
    for s in [] if args.only_frameworks else SCENARIOS:
        events = guarded_run(
            FP16 if s.fp16_storm else TINY, s.steps, policy,
            faults=s.faults, lr_factor=s.lr_factor, data=s.data, fp16_storm=s.fp16_storm,
        )  # fmt: skip
        hit = next((e for e in events if e["kind"] == s.expect and e["step"] >= AT), None)
        early = [e for e in events if e["step"] < AT]
        others = sorted({e["kind"] for e in events if e["kind"] != s.expect})
        step = "-" if hit is None else str(hit["step"])
        latency = "MISSED" if hit is None else str(hit["step"] - AT)
        print(
            f"{s.fault:30} {s.expect:20} {step:>8} {latency:>7}  {s.goal}"
            f"  {', '.join(others) or '-'}{f'  ({len(early)} before the fault!)' if early else ''}",
            flush=True,
        )
    if not args.skip_frameworks:
        print(f"\nunder the framework callbacks (fault at step {FRAMEWORK_AT}):")
        for loop, fault, expect in FRAMEWORK_SCENARIOS:
            events = framework_run(loop, fault, policy)
            hit = next(
                (e for e in events if e["kind"] == expect and e["step"] >= FRAMEWORK_AT), None
            )
            early = [e for e in events if e["step"] < FRAMEWORK_AT]
            latency = "MISSED" if hit is None else str(hit["step"] - FRAMEWORK_AT)
            print(
                f"{loop + ' ' + fault:30} {expect:20} {'-' if hit is None else hit['step']:>8} "
                f"{latency:>7}  0  {len(early)} before the fault",
                flush=True,
            )
    if not (args.skip_clean or args.only_frameworks):
        events = guarded_run(TINY, 2000, policy)
        kinds = sorted({e["kind"] for e in events})
        print(
            f"\nclean 2000-step run, all default detectors: {len(events)} false positive(s) {kinds}"
        )
    print(f"total wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
