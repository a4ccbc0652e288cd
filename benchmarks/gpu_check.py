"""The CUDA paths of a Guard on one real GPU, without Ray: one line per check, PASS or FAIL.

Each check runs the real thing on the GPU and says what it measured:

- `cuda_oom`: a real CUDA out-of-memory error, raised by the caching allocator
  under `torch.cuda.set_per_process_memory_fraction` (not remedy's saved
  activation cap), inside a Guard step; the default policy's `oom-relief`
  chain (activation checkpointing, then a smaller micro-batch) relieves it
  and the step is retried, not lost.
- `memory_stats_leak`: the Guard's CUDA memory readings (allocated, reserved,
  capacity) and the allocator statistics the fragmentation detector reads;
  `memory_growth` fires on a real leak (a tensor kept on the GPU every step)
  and stays silent on the same run without it.
- `nvml`: the NVML sampler (`remedy.rank.loop.hardware`) over the real
  `pynvml`: temperature, memory, ECC and NVLink counters as read.
- `allocator_settings`: `configure_cuda_allocator` turns expandable segments
  on and off, seen in the allocator's own snapshot of its segments.
- `grad_scaler_fp16`: `torch.amp.GradScaler("cuda")` under
  `torch.autocast("cuda", dtype=torch.float16)`, a chaos
  `scaler_overflow_storm` of real float16 overflows, rescued by the default
  policy's `rescale_grad_scaler`; training goes on.
- `activation_checkpointing`: `enable_activation_checkpointing` on the
  example GPT on CUDA: the saved activations (`SavedActivationMeter`) and
  the CUDA peak of a step fall, the gradients stay the same.
- `guard_overhead`: the Guard's per-step cost on the example model
  (examples/pretrain_gpt.py's GPT) and a ~50M-parameter one: guarded and plain
  steps interleaved as in benchmarks/overhead.py, each step timed to a device
  synchronize; the ratio of median step times with its spread over chunks.

Sized to finish in under 5 minutes on one GPU; it has not yet run on one (docs/benchmarks.md).
The device machines have torch, numpy, rich, nvidia-ml-py and pytest but not
remedy's other dependencies; the Guard's path imports no Ray, so the rest
travels as wheels. Here, in the repository's root:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \\
        typing-inspection==0.4.2 typing-extensions==4.16.0 structlog==26.1.0 \\
        tenacity==9.2.1 ruamel.yaml==0.19.1 ruamel.yaml.clib==0.2.15

and there (with `.whl` carried):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=src:/tmp/site python benchmarks/gpu_check.py

    python benchmarks/gpu_check.py --dry-run     # any machine: imports (no Ray), arguments, the list
    python benchmarks/gpu_check.py --only nvml,cuda_oom --pairs 100

Exit status 0 when every check passed, 1 when one failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere in the repo: examples/
sys.path.append(str(ROOT / "src"))  # remedy where it is not installed (PYTHONPATH wins)

from examples.gpt_model import (  # noqa: E402
    GPT,
    GPTConfig,
    SyntheticCorpus,
    cosine_with_warmup,
    lm_loss,
)
from remedy.protocol.commands import Command  # noqa: E402
from remedy.rank.actions.activation_checkpointing import (  # noqa: E402
    SavedActivationMeter,
    checkpointed_modules,
    enable_activation_checkpointing,
)
from remedy.rank.actions.inprocess import apply_command  # noqa: E402
from remedy.rank.chaos.faults import parse_chaos  # noqa: E402
from remedy.rank.detectors import default_detectors  # noqa: E402
from remedy.rank.detectors.memory import MemoryGrowthDetector  # noqa: E402
from remedy.rank.guard import Guard, GuardConfig  # noqa: E402
from remedy.rank.link.context import WorkerContext  # noqa: E402
from remedy.rank.loop.hardware import HardwareSampler  # noqa: E402
from remedy.rundir.writer import read_jsonl  # noqa: E402

_MiB = 1 << 20
_GiB = 1 << 30


class CheckFailed(Exception):
    """A check ran and what it saw is wrong; the message is the FAIL line's reason."""


def expect(condition: bool, reason: str) -> None:
    if not condition:
        raise CheckFailed(reason)


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[argparse.Namespace], str]  # the PASS line's figures
    what: str


# ------------------------------------------------------------------ helpers
def mlp_guard(
    device: torch.device,
    run_dir: Path,
    *,
    steps: int,
    loss_hook: Callable[[], None] | None = None,
    **kwargs: Any,
) -> Guard:
    """A small regression MLP on `device` under a Guard alone (the default policy)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1)).to(device)
    target = torch.randn(64, 1, generator=torch.Generator().manual_seed(1)).to(device)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(i)).to(device)
        return x, torch.tanh(x @ target)

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if loss_hook is not None:
            loss_hook()
        return nn.functional.mse_loss(m(b[0]).float(), b[1])

    faults = kwargs.pop("faults", [])
    scaler = kwargs.pop("scaler", None)
    return Guard(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        loss_fn=loss_fn,
        data=batch,
        max_steps=steps,
        scaler=scaler,
        context=WorkerContext(run_dir=run_dir, faults=list(faults)),
        config=GuardConfig(**kwargs),
    )


def train(guard: Guard) -> dict[str, Any]:
    for b in guard:
        guard.step(b)
    return guard.close()


def release() -> None:
    """Give cached CUDA memory back between checks, so each starts from an empty pool."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def gib(n: float) -> str:
    return f"{n / _GiB:.2f} GiB"


# ------------------------------------------------------------------ cuda_oom
OOM_CFG = GPTConfig(n_layer=8, n_head=8, n_embd=256, block_size=256)
OOM_BATCH = 64


def _oom_model(device: torch.device) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(OOM_CFG).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def step_peak(
    device: torch.device, batch: torch.Tensor, *, fraction: float | None, micro: int
) -> int:
    """Peak reserved CUDA bytes of two plain steps (the second with AdamW's state in place),
    with `fraction` of the blocks checkpointed and the batch split into `micro` micro-batches."""
    release()
    model, opt = _oom_model(device)
    if fraction is not None:
        enable_activation_checkpointing(model, fraction=fraction)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        for chunk in batch.chunk(micro):
            (lm_loss(model, chunk) * (chunk.shape[0] / batch.shape[0])).backward()
        opt.step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    del model, opt
    release()
    return peak


def check_cuda_oom(args: argparse.Namespace) -> str:
    device = torch.device("cuda")
    corpus = SyntheticCorpus(
        vocab_size=OOM_CFG.vocab_size, block_size=OOM_CFG.block_size, batch_size=OOM_BATCH
    )
    full = step_peak(device, corpus.batch(0).to(device), fraction=None, micro=1)
    # The default policy's oom-relief: half the blocks checkpointed, then micro-batches halved.
    relieved = step_peak(device, corpus.batch(0).to(device), fraction=0.5, micro=2)
    expect(
        full > 1.5 * relieved,
        f"calibration: a full step peaks at {gib(full)}, the relieved one at {gib(relieved)}: "
        "too close to place a memory cap between them",
    )
    cap = int(math.sqrt(full * relieved))  # well under the full step, well over the relieved
    total = torch.cuda.get_device_properties(device).total_memory
    ooms_before = torch.cuda.memory_stats(device).get("num_ooms", 0)
    model, opt = _oom_model(device)
    with tempfile.TemporaryDirectory() as tmp:
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        try:
            guard = Guard(
                model,
                opt,
                loss_fn=lm_loss,
                data=lambda i: corpus.batch(i).to(device),
                max_steps=4,
                context=WorkerContext(run_dir=Path(tmp)),
                config=GuardConfig(policy="default", checkpoint_every=0),
            )
            results = [guard.step(b) for b in guard]
            summary = guard.close()
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        anomalies = read_jsonl(Path(tmp) / "anomalies.jsonl")
        decisions = read_jsonl(Path(tmp) / "decisions.jsonl")
    ooms = torch.cuda.memory_stats(device).get("num_ooms", 0) - ooms_before
    oom_events = [a for a in anomalies if a["kind"] == "oom"]
    expect(bool(oom_events), f"no oom anomaly under a cap of {gib(cap)} (full step {gib(full)})")
    message = str(oom_events[0].get("details", {}).get("message", ""))
    expect(
        "CUDA out of memory" in message, f"the OOM was not the CUDA allocator's: {message[:120]!r}"
    )
    expect(ooms >= 1, "torch.cuda.memory_stats counted no OOM")
    applied = [d["action"] for d in decisions if d["outcome"] == "applied"]
    expect(
        any(a in applied for a in ("enable_activation_checkpointing", "reduce_microbatch")),
        f"the OOM chain applied nothing: {[(d['action'], d['outcome']) for d in decisions]}",
    )
    expect(
        summary["status"] == "completed" and summary["steps_completed"] == 4,
        f"run {summary['status']} after {summary['steps_completed']} steps "
        f"({summary.get('stop_reason')})",
    )
    expect(math.isfinite(results[0].loss), "the OOM'd step was not retried to a finite loss")
    expect(not results[0].optimizer_skipped, "the OOM'd step's update was skipped, not retried")
    return (
        f"full step {gib(full)}, relieved {gib(relieved)}, cap {gib(cap)} "
        f"(fraction {cap / total:.4f}); {ooms} allocator OOM(s) ({message[:60]!r}); "
        f"applied {applied}; micro-batches {guard.micro_batches}, "
        f"{len(checkpointed_modules(model))} blocks checkpointed; "
        f"4/4 steps, step 0 loss {results[0].loss:.3f}"
    )


# ------------------------------------------------------------------ memory_stats_leak
LEAK_BYTES = 8 * _MiB


def leak_run(
    device: torch.device, *, leak: bool, steps: int = 70
) -> tuple[Guard, list[dict[str, Any]], int]:
    """A Guard run with a fast memory_growth detector; `leak` keeps 8 MiB on `device` each step.
    Returns the Guard, the anomalies it reported and the bytes kept."""
    kept: list[torch.Tensor] = []

    def hook() -> None:
        if leak:  # the user's bug: a tensor kept alive every step
            kept.append(torch.ones(LEAK_BYTES // 4, device=device))

    growth = MemoryGrowthDetector(
        block=5, window_blocks=6, min_growth_bytes=64 * _MiB, patience=2, warmup_steps=10
    )
    with tempfile.TemporaryDirectory() as tmp:
        guard = mlp_guard(
            device, Path(tmp), steps=steps, loss_hook=hook, detectors=[growth], checkpoint_every=0
        )
        train(guard)
        anomalies = read_jsonl(Path(tmp) / "anomalies.jsonl")
    kept_bytes = sum(t.numel() * t.element_size() for t in kept)
    return guard, anomalies, kept_bytes


def check_memory_stats_leak(args: argparse.Namespace) -> str:
    device = torch.device("cuda")
    release()
    clean, clean_anomalies, _ = leak_run(device, leak=False)
    release()
    leaky, leak_anomalies, kept = leak_run(device, leak=True)
    clean_kinds = [a["kind"] for a in clean_anomalies]
    leak_kinds = [a["kind"] for a in leak_anomalies]
    last = leaky.recent_stats[-1]
    first_clean, last_clean = clean.recent_stats[0], clean.recent_stats[-1]
    expect(
        None not in (last.mem_bytes, last.mem_reserved_bytes, last.mem_capacity_bytes),
        f"the Guard read no CUDA memory statistics: {last.mem_bytes}, "
        f"{last.mem_reserved_bytes}, {last.mem_capacity_bytes}",
    )
    assert last.mem_bytes is not None and last.mem_reserved_bytes is not None
    expect(last.mem_bytes >= kept, f"allocated {last.mem_bytes} < the {kept} bytes kept")
    expect(last.mem_reserved_bytes >= last.mem_bytes, "reserved below allocated")
    expect(
        last.mem_capacity_bytes == torch.cuda.get_device_properties(device).total_memory,
        "capacity is not the device's memory",
    )
    stats = torch.cuda.memory_stats(device)
    for key in ("reserved_bytes.all.current", "inactive_split_bytes.all.current"):
        expect(key in stats, f"torch.cuda.memory_stats has no {key!r}")
    stranded = stats["inactive_split_bytes.all.current"] / max(
        stats["reserved_bytes.all.current"], 1
    )
    expect(
        "memory_growth" in leak_kinds,
        f"no memory_growth on a leak of {kept >> 20} MiB: {leak_kinds}",
    )
    expect("memory_growth" not in clean_kinds, f"memory_growth on the clean run: {clean_kinds}")
    step = next(a["step"] for a in leak_anomalies if a["kind"] == "memory_growth")
    del leaky
    release()
    return (
        f"leak {LEAK_BYTES >> 20} MiB/step: memory_growth at step {step}, "
        f"allocated {last.mem_bytes / _MiB:.0f} MiB, reserved {last.mem_reserved_bytes / _MiB:.0f} "
        f"MiB of {gib(last.mem_capacity_bytes or 0)}; clean run: none, allocated "
        f"{(first_clean.mem_bytes or 0) / _MiB:.1f} -> {(last_clean.mem_bytes or 0) / _MiB:.1f} "
        f"MiB; stranded in split segments {stranded:.1%}"
    )


# ------------------------------------------------------------------ nvml
def check_nvml(args: argparse.Namespace) -> str:
    sampler = HardwareSampler(interval_s=0.5)
    expect(sampler.open(), f"NVML did not open: {sampler.reason}")
    try:
        nvml = sampler._nvml
        assert nvml is not None
        lib = nvml.lib
        parts = []
        for dev in sampler._devices:
            reading = nvml.read(dev, now=time.monotonic(), active=True)
            mem = lib.nvmlDeviceGetMemoryInfo(dev.handle)
            expect(reading.temperature_c is not None, f"GPU {dev.index}: no temperature read")
            expect(int(mem.total) > 0, f"GPU {dev.index}: NVML memory total {mem.total}")
            ecc = (
                f"ECC corrected {reading.ecc_corrected}, uncorrected {reading.ecc_uncorrected}"
                if reading.ecc_corrected is not None or reading.ecc_uncorrected is not None
                else "ECC not reported (off or unsupported)"
            )
            nvlink = (
                f"NVLink {len(dev.nvlinks)} active links, counters "
                f"{dict(list((reading.nvlink_errors or {}).items())[:4])}"
                + (" ..." if len(reading.nvlink_errors or {}) > 4 else "")
                if dev.nvlinks
                else "NVLink: no active link"
            )
            parts.append(
                f"GPU {dev.index} {reading.temperature_c} C, memory used "
                f"{int(mem.used) / _GiB:.2f} of {int(mem.total) / _GiB:.2f} GiB, util "
                f"{reading.util_pct}%, throttle reasons {reading.throttle_reasons}, PCIe "
                f"x{reading.pcie_width}/x{reading.pcie_max_width} {reading.pcie_kbps} KB/s, "
                f"{ecc}, {nvlink}"
            )
        findings = sampler.sample_once()
        driver = lib.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    finally:
        sampler.stop()
    return f"driver {driver}; " + "; ".join(parts) + f"; findings on one sample: {len(findings)}"


# ------------------------------------------------------------------ allocator_settings
def _segment_of(tensor: torch.Tensor) -> dict[str, Any] | None:
    """The allocator's segment holding `tensor`, from its own snapshot."""
    address = tensor.data_ptr()
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if seg["address"] <= address < seg["address"] + seg["total_size"]:
            return dict(seg)
    return None


def check_allocator_settings(args: argparse.Namespace) -> str:
    device = torch.device("cuda")
    release()
    with tempfile.TemporaryDirectory() as tmp:
        guard = mlp_guard(device, Path(tmp), steps=2, checkpoint_every=0)
        train(guard)
        seen = []
        for on in (True, False):
            outcome = apply_command(
                guard,
                Command(
                    f"gpu-check-{on}", "configure_cuda_allocator", {"expandable_segments": on}, 0, 0
                ),
            )
            expect(outcome.outcome == "applied", f"expandable_segments={on}: {outcome.detail}")
            probe = torch.empty(256 * _MiB, dtype=torch.uint8, device=device)
            seg = _segment_of(probe)
            expect(seg is not None, "the probe tensor is in no segment of the allocator's snapshot")
            assert seg is not None
            expect(
                "is_expandable" in seg,
                f"the snapshot's segments carry no is_expandable: {sorted(seg)}",
            )
            expect(
                bool(seg["is_expandable"]) == on,
                f"after expandable_segments={on} a new segment has is_expandable="
                f"{seg['is_expandable']}",
            )
            seen.append(f"{outcome.result.get('settings')} -> is_expandable {seg['is_expandable']}")
            del probe
            release()
    return "; ".join(seen)


# ------------------------------------------------------------------ grad_scaler_fp16
def check_grad_scaler_fp16(args: argparse.Namespace) -> str:
    release()
    return scaler_storm(torch.device("cuda"))


def scaler_storm(device: torch.device) -> str:
    """A 30-step overflow storm through the real GradScaler of `device` in float16 (on CPU too)."""
    faults = parse_chaos(
        {"faults": [{"kind": "scaler_overflow_storm", "at_step": 5, "duration": 30}]}
    )
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    with tempfile.TemporaryDirectory() as tmp:
        guard = mlp_guard(
            device,
            Path(tmp),
            steps=60,
            faults=faults,
            scaler=scaler,
            amp_dtype=torch.float16,
            checkpoint_every=0,
        )
        summary = train(guard)
        metrics = read_jsonl(Path(tmp) / "metrics.jsonl")
        anomalies = [a["kind"] for a in read_jsonl(Path(tmp) / "anomalies.jsonl")]
        decisions = read_jsonl(Path(tmp) / "decisions.jsonl")
    skipped = [m["step"] for m in metrics if m["optimizer_skipped"]]
    expect(skipped == list(range(5, 35)), f"skipped steps {skipped}, expected 5..34 alone")
    expect("scaler_overflow" in anomalies, f"no scaler_overflow: {anomalies}")
    rescues = [
        d for d in decisions if d["action"] == "rescale_grad_scaler" and d["outcome"] == "applied"
    ]
    expect(bool(rescues), f"no rescale_grad_scaler applied: {[d['action'] for d in decisions]}")
    after = [m for m in metrics if m["step"] >= 35]
    expect(
        bool(after) and not any(m["optimizer_skipped"] for m in after),
        f"updates still skipped after the storm: {[m['step'] for m in after if m['optimizer_skipped']]}",
    )
    expect(summary["steps_completed"] == 60, f"{summary['steps_completed']} of 60 steps")
    scales = [m["loss_scale"] for m in metrics]
    return (
        f"30 float16 overflow steps skipped by the {device.type} GradScaler (scale {scales[4]:g} -> "
        f"{min(scales):g}); scaler_overflow -> rescale_grad_scaler at step {rescues[0]['step']} "
        f"({rescues[0]['params']}); steps 35-59 all updated, final scale {scales[-1]:g}"
    )


# ------------------------------------------------------------------ activation_checkpointing
AC_CFG = GPTConfig(n_layer=6, n_head=8, n_embd=256, block_size=256)


def forward_backward(model: GPT, batch: torch.Tensor) -> tuple[int, int, list[torch.Tensor]]:
    """Saved activation bytes, the step's CUDA peak above its start, and the gradients."""
    model.zero_grad(set_to_none=True)
    release()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with SavedActivationMeter() as meter:
        loss = lm_loss(model, batch)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return meter.peak, peak, grads


def check_activation_checkpointing(args: argparse.Namespace) -> str:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = GPT(AC_CFG).to(device)
    corpus = SyntheticCorpus(
        vocab_size=AC_CFG.vocab_size, block_size=AC_CFG.block_size, batch_size=32
    )
    batch = corpus.batch(0).to(device)
    saved_before, peak_before, grads_before = forward_backward(model, batch)
    with tempfile.TemporaryDirectory() as tmp:
        guard = Guard(
            model,
            torch.optim.AdamW(model.parameters(), lr=3e-4),
            loss_fn=lm_loss,
            data=lambda i: corpus.batch(i).to(device),
            max_steps=3,
            context=WorkerContext(run_dir=Path(tmp)),
            config=GuardConfig(checkpoint_every=0),
        )
        outcome = apply_command(
            guard,
            Command("gpu-check-ac", "enable_activation_checkpointing", {"fraction": 1.0}, 0, 0),
        )
        expect(outcome.outcome == "applied", f"enable_activation_checkpointing: {outcome.detail}")
        saved_after, peak_after, grads_after = forward_backward(model, batch)
        summary = train(guard)  # the Guard trains on with every block checkpointed
    expect(saved_after < saved_before, f"saved activations {saved_before} -> {saved_after}")
    expect(peak_after < peak_before, f"CUDA step peak {peak_before} -> {peak_after}")
    worst = max(float((a - b).abs().max()) for a, b in zip(grads_before, grads_after, strict=True))
    expect(worst <= 1e-4, f"gradients changed by up to {worst:.2e} under checkpointing")
    expect(summary["steps_completed"] == 3, f"{summary['steps_completed']} of 3 steps trained")
    return (
        f"{len(checkpointed_modules(model))} blocks: saved activations {saved_before / _MiB:.0f} -> "
        f"{saved_after / _MiB:.0f} MiB, CUDA step peak {peak_before / _MiB:.0f} -> "
        f"{peak_after / _MiB:.0f} MiB, gradients equal within {worst:.1e}; 3 Guard steps trained"
    )


# ------------------------------------------------------------------ guard_overhead
@dataclass(frozen=True)
class Setup:
    name: str
    cfg: GPTConfig
    batch: int
    lr: float = 3e-3


OVERHEAD_SETUPS = [
    # examples/pretrain_gpt.py's defaults: 4 layers, width 128, 64 tokens, batches of 16.
    Setup("example", GPTConfig(), 16),
    # benchmarks/overhead.py's 50M: 8 blocks of width 704, a 4096-token vocabulary.
    Setup(
        "50M",
        GPTConfig(n_layer=8, n_embd=704, n_head=8, block_size=128, vocab_size=4096),
        8,
        lr=6e-4,
    ),
]


class Trainer:
    """One model, optimizer, scheduler and batch stream on `device`; `step()` runs one step."""

    def __init__(self, s: Setup, total: int, device: torch.device, *, guarded: bool) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = GPT(s.cfg).to(device)
        # The example's optimizer (examples/pretrain_gpt.py).
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=s.lr, weight_decay=0.01, betas=(0.9, 0.95)
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, cosine_with_warmup(30, total))
        self.corpus = SyntheticCorpus(
            vocab_size=s.cfg.vocab_size, block_size=s.cfg.block_size, batch_size=s.batch
        )
        self.index = 0
        self.guard: Guard | None = None
        if guarded:
            self.guard = Guard(
                self.model,
                self.opt,
                loss_fn=lm_loss,
                data=lambda i: self.corpus.batch(i).to(device),
                scheduler=self.sched,
                max_steps=total,
                config=GuardConfig(detectors=default_detectors(self.model)),
            )
            self._it = iter(self.guard)

    def step(self) -> None:
        if self.guard is not None:
            self.guard.step(next(self._it))
            return
        batch = self.corpus.batch(self.index).to(self.device)
        self.index += 1
        self.opt.zero_grad(set_to_none=True)
        lm_loss(self.model, batch).backward()
        self.opt.step()
        self.sched.step()

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def guarded_vs_plain(
    s: Setup, device: torch.device, *, pairs: int, warmup: int, chunks: int = 10
) -> dict[str, Any]:
    """Guarded and plain steps interleaved (ABBA), each timed to a device synchronize.

    Every step ends with a synchronize on both sides, so the plain loop is not
    credited with work still queued on the device. Snapshot steps are kept
    in: the median passes over them (one step in ten), the mean ratio counts
    them. Returns the median step times, their ratio, the ratio per chunk of
    consecutive pairs, a 95% bootstrap interval of the median over those
    chunks, and the ratio of mean step times.
    """
    total = warmup + pairs + 1
    plain = Trainer(s, total, device, guarded=False)
    guarded = Trainer(s, total, device, guarded=True)
    for _ in range(warmup):
        plain.step()
        guarded.step()
    _sync(device)
    p_times: list[float] = []
    g_times: list[float] = []
    for i in range(pairs):
        for trainer in (plain, guarded) if i % 2 == 0 else (guarded, plain):
            t0 = time.perf_counter()
            trainer.step()
            _sync(device)
            (g_times if trainer is guarded else p_times).append(time.perf_counter() - t0)
    guarded.close()
    size = max(pairs // chunks, 1)
    ratios = [
        statistics.median(g_times[k : k + size]) / statistics.median(p_times[k : k + size])
        for k in range(0, pairs - size + 1, size)
    ]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return {
        "params": plain.model.num_params(),
        "plain_ms": statistics.median(p_times) * 1e3,
        "guarded_ms": statistics.median(g_times) * 1e3,
        "ratio": statistics.median(g_times) / statistics.median(p_times),
        # Every step, the Guard's snapshot steps (one in ten, host copies) included.
        "mean_ratio": statistics.fmean(g_times) / statistics.fmean(p_times),
        "chunk_ratios": ratios,
        "low": boot[int(0.025 * len(boot))],
        "high": boot[int(0.975 * len(boot)) - 1],
    }


def check_guard_overhead(args: argparse.Namespace) -> str:
    device = torch.device("cuda")
    rows = []
    for s in OVERHEAD_SETUPS:
        release()
        r = guarded_vs_plain(s, device, pairs=args.pairs, warmup=20)
        expect(
            all(math.isfinite(x) and x > 0 for x in (r["plain_ms"], r["guarded_ms"])),
            f"{s.name}: step times {r['plain_ms']}, {r['guarded_ms']}",
        )
        rows.append(
            f"{s.name} ({r['params'] / 1e6:.1f}M params): plain {r['plain_ms']:.2f} ms, guarded "
            f"{r['guarded_ms']:.2f} ms, ratio {r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}] "
            f"(chunks {min(r['chunk_ratios']):.3f}..{max(r['chunk_ratios']):.3f}), "
            f"mean ratio {r['mean_ratio']:.3f} with snapshots"
        )
    return f"{args.pairs} interleaved pairs each: " + "; ".join(rows)


# ------------------------------------------------------------------ driver
CHECKS = [
    Check(
        "cuda_oom",
        check_cuda_oom,
        "a real CUDA allocator OOM in a Guard step, relieved by the OOM chain",
    ),
    Check(
        "memory_stats_leak",
        check_memory_stats_leak,
        "CUDA memory statistics; memory_growth on a real leak, none on a clean run",
    ),
    Check(
        "nvml", check_nvml, "NVML telemetry from the real library: temperature, memory, ECC, NVLink"
    ),
    Check("allocator_settings", check_allocator_settings, "configure_cuda_allocator applied"),
    Check(
        "grad_scaler_fp16",
        check_grad_scaler_fp16,
        "GradScaler('cuda') under float16 autocast, an overflow storm rescued",
    ),
    Check(
        "activation_checkpointing",
        check_activation_checkpointing,
        "enable_activation_checkpointing on CUDA: less saved, same gradients",
    ),
    Check(
        "guard_overhead", check_guard_overhead, "guarded vs plain step time on the GPU, interleaved"
    ),
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the imports (no Ray), the arguments and list the checks; no GPU needed",
    )
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    p.add_argument("--pairs", type=int, default=300, help="interleaved step pairs per overhead row")
    args = p.parse_args(argv)
    names = [c.name for c in CHECKS]
    args.selected = [n.strip() for n in args.only.split(",") if n.strip()] or names
    unknown = [n for n in args.selected if n not in names]
    if unknown:
        p.error(f"--only: unknown check {unknown[0]!r}; the checks are {', '.join(names)}")
    if args.pairs < 10:
        p.error(f"--pairs must be at least 10 (one per chunk), got {args.pairs}")
    return args


def dry_run(args: argparse.Namespace) -> int:
    """Imports done (at the top), no Ray among them; the policy loads; NVML answers or not."""
    from remedy.policies import load_policy  # noqa: PLC0415 - as the Guard loads it, lazily

    policy = load_policy("default")
    loaded_ray = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
    if loaded_ray:
        print(f"FAIL imports: the GPU check's path imported Ray ({loaded_ray[0]})")
        return 1
    remedy_dir = Path(sys.modules["remedy"].__file__ or "?").parent
    print(
        f"imports ok: torch {torch.__version__}, remedy from {remedy_dir}, "
        f"default policy {policy.name!r} ({len(policy.rules)} rules); ray not imported"
    )
    sampler = HardwareSampler()
    state = "on" if sampler.open() else f"off ({sampler.reason})"
    sampler.stop()
    print(f"nvml: {state}; cuda: {'available' if torch.cuda.is_available() else 'not available'}")
    for name in args.selected:
        check = next(c for c in CHECKS if c.name == name)
        print(f"would run {check.name}: {check.what}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:
        return dry_run(args)
    if not torch.cuda.is_available():
        print(
            f"FAIL cuda: no CUDA device visible to torch {torch.__version__} (cuda {torch.version.cuda})"
        )
        return 1
    props = torch.cuda.get_device_properties(0)
    print(
        f"torch {torch.__version__} (cuda {torch.version.cuda}), {props.name}, {gib(props.total_memory)}"
    )
    failed = 0
    t_start = time.perf_counter()
    for name in args.selected:
        check = next(c for c in CHECKS if c.name == name)
        t0 = time.perf_counter()
        try:
            line = f"PASS {name}: {check.run(args)}"
        except CheckFailed as exc:
            line, failed = f"FAIL {name}: {exc}", failed + 1
        except Exception as exc:  # one line per check, whatever broke
            where = traceback.extract_tb(exc.__traceback__)[-1]
            first = str(exc).splitlines()[0] if str(exc) else ""
            line = f"FAIL {name}: {type(exc).__name__}: {first} (at {Path(where.filename).name}:{where.lineno})"
            failed += 1
        finally:
            # A check that failed half-way must not leave its memory cap on the next one.
            with contextlib.suppress(Exception):
                torch.cuda.set_per_process_memory_fraction(1.0)
            release()
        print(f"{line} [{time.perf_counter() - t0:.1f} s]", flush=True)
    print(
        f"{len(args.selected) - failed}/{len(args.selected)} passed in {time.perf_counter() - t_start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
