"""Memory detectors: a real leak in a guarded run is memory_growth; pressure and fragmentation
fire on their thresholds and stay quiet on CPU and clean runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.gpt_model import GPT, GPTConfig, SyntheticCorpus, lm_loss
from remedy.rank.chaos.faults import Fault
from remedy.rank.detectors import (
    MemoryFragmentationDetector,
    MemoryGrowthDetector,
    MemoryPressureDetector,
)
from remedy.rank.detectors.memory import host_memory_bytes
from remedy.rank.detectors.testing import feed, run_guarded, step_stats
from remedy.rank.loop.measure import process_rss_bytes

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]
MiB = 1 << 20
GiB = 1 << 30


def guarded_tiny(tmp_path: Path, steps: int, faults: list[Fault]) -> list[tuple[str, int]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, block_size=32))
    corpus = SyntheticCorpus(block_size=32, batch_size=8)
    run = run_guarded(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        loss_fn=lm_loss,
        data=corpus.batch,
        steps=steps,
        detectors=[MemoryGrowthDetector(), MemoryPressureDetector()],
        faults=faults,
        policy_dir=tmp_path,
    )
    return [(e.kind, e.step) for e in run.events]


def test_real_leak_is_memory_growth(tmp_path: Path) -> None:
    """The chaos memory_leak keeps 2 MiB alive per step from step 220: memory_growth within
    about one window (100 steps) of the leak's start."""
    leak = Fault(kind="memory_leak", at_step=220, duration=200, bytes=2 * MiB)
    events = guarded_tiny(tmp_path, 340, [leak])
    assert [k for k, _ in events] == ["memory_growth"]
    assert 220 < events[0][1] <= 330


def test_clean_run_has_no_memory_events(tmp_path: Path) -> None:
    """The same run without the leak (snapshot ring filling included) raises nothing."""
    assert guarded_tiny(tmp_path, 340, []) == []


def test_growth_ignores_sawtooth_and_one_off_jumps() -> None:
    """Peaks inside blocks and a single step up are not a leak; only a rising floor is."""
    base = 4 * GiB
    saw = [base + (512 * MiB if i % 10 == 5 else 0) for i in range(600)]
    jump = [base + (300 * MiB if i > 400 else 0) for i in range(600)]
    for series in (saw, jump):
        assert (
            feed(MemoryGrowthDetector(), [step_stats(i, mem_bytes=m) for i, m in enumerate(series)])
            == []
        )
    leak = [base + max(0, i - 300) * MiB for i in range(600)]
    events = feed(MemoryGrowthDetector(), [step_stats(i, mem_bytes=m) for i, m in enumerate(leak)])
    assert events and events[0].details["bytes_per_step"] == pytest.approx(MiB, rel=0.05)


def test_pressure_against_real_rss() -> None:
    """The process's real RSS against a capacity just above it is pressure (after 3 steps)."""
    rss = process_rss_bytes()
    assert rss is not None
    det = MemoryPressureDetector(capacity_bytes=int(rss / 0.95))
    events = feed(det, [step_stats(i, mem_bytes=process_rss_bytes()) for i in range(4)])
    assert [e.kind for e in events] == ["memory_pressure"]
    assert events[0].step == 2


def test_pressure_uses_device_then_host_capacity() -> None:
    """CUDA numbers use the device capacity (reserved counts); on CPU the host's memory."""
    det = MemoryPressureDetector(patience=1)
    gpu = step_stats(
        0, mem_bytes=60 * GiB, mem_reserved_bytes=79 * GiB, mem_capacity_bytes=80 * GiB
    )
    (ev,) = det.observe(gpu)
    assert ev.value == pytest.approx(79 / 80) and ev.severity == "critical"
    host = host_memory_bytes()
    assert host is not None and host > 0
    assert MemoryPressureDetector(patience=1).observe(step_stats(1, mem_bytes=host // 2)) == []


def test_fragmentation_silent_on_cpu() -> None:
    """No caching allocator on CPU (reserved is None): never a fragmentation event."""
    det = MemoryFragmentationDetector(every=1, patience=1, min_reserved_bytes=0)
    assert feed(det, [step_stats(i, mem_bytes=GiB) for i in range(50)]) == []


@pytest.mark.parametrize(
    ("stranded", "reserved", "fires"),
    [(4 * GiB, 10 * GiB, True), (2 * GiB, 10 * GiB, False), (400 * MiB, 900 * MiB, False)],
)
def test_fragmentation_from_allocator_stats(stranded: int, reserved: int, fires: bool) -> None:
    """Stranded split-segment bytes above 30% of ≥1 GiB reserved, 3 reads running, fire."""
    stats = {"reserved_bytes.all.current": reserved, "inactive_split_bytes.all.current": stranded}
    det = MemoryFragmentationDetector(stats_fn=lambda: stats)
    stream = [
        step_stats(i, mem_bytes=reserved // 2, mem_reserved_bytes=reserved) for i in range(40)
    ]
    events = feed(det, stream)
    assert [e.step for e in events] == ([20] if fires else [])


def test_fragmentation_reserved_free_measure() -> None:
    """`measure="reserved_free"` reads 1 - allocated/reserved from the step numbers."""
    det = MemoryFragmentationDetector(measure="reserved_free", every=1, patience=1)
    (ev,) = det.observe(step_stats(0, mem_bytes=3 * GiB, mem_reserved_bytes=10 * GiB))
    assert ev.value == pytest.approx(0.7)


@pytest.mark.gpu
def test_fragmentation_on_real_cuda_allocator() -> None:
    """Freeing every other 3 MiB block strands half of each 20 MiB segment: fragmentation."""
    blocks = [torch.empty(3 * MiB, dtype=torch.uint8, device="cuda") for _ in range(120)]
    del blocks[::2]
    torch.cuda.synchronize()
    det = MemoryFragmentationDetector(every=1, patience=1, min_reserved_bytes=0)
    reserved = torch.cuda.memory_reserved()
    (ev,) = det.observe(
        step_stats(0, mem_bytes=torch.cuda.memory_allocated(), mem_reserved_bytes=reserved)
    )
    assert ev.value is not None and ev.value > 0.3
    del blocks
    torch.cuda.empty_cache()
