"""The NVML sampler against a fake NVML module (no GPU exists on CI), and without any driver."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from remedy.rank.detectors import GpuHealth, GpuReading, GpuThresholds, HardwareMonitor
from remedy.rank.detectors.testing import step_stats
from remedy.rank.loop import hardware
from remedy.rank.loop.hardware import HardwareSampler, get_sampler, stop_sampler

pytestmark = pytest.mark.timeout(60)


class FakeNVMLError(Exception):
    pass


@dataclass(eq=False)
class FakeGpu:
    temp: float = 60.0
    reasons: int = 0x4  # software power cap: normal under load
    ecc: list[int] = field(default_factory=lambda: [0, 0])  # corrected, uncorrected
    util: float = 95.0
    pcie: tuple[float, float] = (2e6, 2e6)  # KB/s tx, rx
    width: int = 16
    max_width: int = 16
    links: dict[int, dict[int, int]] = field(
        default_factory=lambda: {0: {0: 0, 1: 0, 2: 0, 3: 0}, 1: {0: 0, 1: 0, 2: 0, 3: 0}}
    )
    no_ecc: bool = False


class FakeNvml:
    """The handful of pynvml functions `workers.hardware.Nvml` calls, over FakeGpu state."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.calls: dict[str, int] = {}
        self.shutdown = False

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def nvmlInit(self) -> None:
        self._count("init")

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> bytes:
        return f"GPU-{self.gpus.index(h)}".encode()

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> float:
        return h.temp

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGpu) -> int:
        return h.reasons

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, kind: int, counter: int) -> int:
        self._count("ecc")
        if h.no_ecc:
            raise FakeNVMLError("Not Supported")
        return h.ecc[kind]

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:
        return type("Util", (), {"gpu": h.util, "memory": 10})()

    def nvmlDeviceGetPcieThroughput(self, h: FakeGpu, which: int) -> float:
        return h.pcie[which]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: FakeGpu) -> int:
        return h.width

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: FakeGpu) -> int:
        return h.max_width

    def nvmlDeviceGetNvLinkState(self, h: FakeGpu, link: int) -> int:
        if link not in h.links:
            raise FakeNVMLError("Invalid Argument")
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: FakeGpu, link: int, counter: int) -> int:
        return h.links[link][counter]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _fresh_singleton(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test sees all GPUs and starts without a process-wide sampler."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    stop_sampler()
    yield
    stop_sampler()


def sampler_for(gpus: list[FakeGpu], **kw: Any) -> tuple[HardwareSampler, FakeNvml, Clock]:
    fake, clock = FakeNvml(gpus), Clock()
    s = HardwareSampler(fake, clock=clock, **kw)
    assert s.open()
    s.last_activity = clock.now  # training is progressing
    return s, fake, clock


def run(s: HardwareSampler, clock: Clock, n: int) -> list[tuple[int, str]]:
    out = []
    for _ in range(n):
        clock.now += 1.0
        s.last_activity = clock.now
        out += [(gpu, f.kind) for gpu, _, f in s.sample_once()]
    return out


def test_healthy_gpus_are_silent() -> None:
    """Two busy, cool, error-free GPUs under a power cap: ten minutes of samples, no finding."""
    s, _, clock = sampler_for([FakeGpu(), FakeGpu()])
    assert run(s, clock, 600) == []


def test_temperature_limit_and_jump() -> None:
    """Above 85 °C is gpu_thermal at once; a 15 °C jump counts only after the warm-up."""
    gpu = FakeGpu(temp=50.0)
    s, _, clock = sampler_for([gpu])
    gpu.temp = 70.0  # the job just started: warming up is normal
    assert run(s, clock, 10) == []
    run(s, clock, 300)
    gpu.temp = 86.0
    assert run(s, clock, 1) == [(0, "gpu_thermal")]
    gpu.temp = 70.0
    s2, _, clock2 = sampler_for([FakeGpu(temp=60.0)])
    run(s2, clock2, 400)
    s2._devices[0].handle.temp = 78.0
    (found,) = s2.sample_once()
    assert found[2].details["reason"] == "jump"


def test_throttle_reasons_need_persistence() -> None:
    """Hardware slowdown bits for 3 samples in a row are gpu_throttle; a blip is not."""
    gpu = FakeGpu()
    s, _, clock = sampler_for([gpu])
    gpu.reasons = 0x4 | 0x40  # hardware thermal slowdown
    assert run(s, clock, 2) == []
    gpu.reasons = 0x4
    assert run(s, clock, 1) == []
    gpu.reasons = 0x80
    found = run(s, clock, 3)
    assert found == [(0, "gpu_throttle")]


def test_new_ecc_errors() -> None:
    """Errors present at start are history; a new uncorrected error is critical gpu_ecc."""
    gpu = FakeGpu(ecc=[5, 1])
    s, _, clock = sampler_for([gpu])
    assert run(s, clock, 5) == []
    gpu.ecc[1] = 2
    clock.now += 1
    (item,) = s.sample_once()
    assert item[2].kind == "gpu_ecc" and item[2].severity == "critical"


def test_unsupported_metric_is_asked_once() -> None:
    """A GPU without ECC raises NotSupported once; the sampler stops asking and carries on."""
    gpu = FakeGpu(no_ecc=True)
    s, fake, clock = sampler_for([gpu])
    run(s, clock, 20)
    assert fake.calls["ecc"] == 2  # corrected and uncorrected, once each


def test_util_drop_only_while_training() -> None:
    """Utilization falling to a fifth of its median while steps progress is gpu_util_drop;
    the same drop with no training (eval, checkpoint) is not."""
    gpu = FakeGpu()
    s, _, clock = sampler_for([gpu])
    run(s, clock, 30)
    gpu.util = 20.0
    clock.now += s.active_window_s  # no step has been observed for a while
    for _ in range(10):
        clock.now += 1.0
        assert s.sample_once() == []
    assert run(s, clock, 5)[-1:] == [(0, "gpu_util_drop")]


def test_pcie_throughput_drop_and_link_width() -> None:
    """PCIe throughput collapsing is pcie_throughput_drop; so is a link trained to x8 of x16."""
    gpu = FakeGpu()
    s, _, clock = sampler_for([gpu])
    run(s, clock, 30)
    gpu.pcie = (1e5, 1e5)
    assert run(s, clock, 5)[-1:] == [(0, "pcie_throughput_drop")]
    gpu2 = FakeGpu(width=8)
    s2, _, clock2 = sampler_for([gpu2])
    (found,) = run(s2, clock2, 1)
    assert found == (0, "pcie_throughput_drop")


def test_nvlink_counter_increase() -> None:
    """Any NVLink replay/recovery/CRC counter going up is nvlink_error with the deltas."""
    gpu = FakeGpu()
    s, _, clock = sampler_for([gpu])
    run(s, clock, 3)
    gpu.links[1][0] += 4  # replays on link 1
    clock.now += 1
    (item,) = s.sample_once()
    assert item[2].kind == "nvlink_error" and item[2].details["counters"] == {"link1.replay": 4}


def test_cooldown_per_kind_and_gpu() -> None:
    """A condition that persists is reported again only after `cooldown_s`."""
    gpu = FakeGpu(temp=90.0)
    s, _, clock = sampler_for([gpu], thresholds=GpuThresholds(cooldown_s=100.0))
    found = run(s, clock, 250)
    assert found == [(0, "gpu_thermal")] * 3


def test_visible_devices_select_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES (index or UUID) limits the watched GPUs: one rank, one GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2,1")
    s, _, _ = sampler_for([FakeGpu(), FakeGpu(), FakeGpu()])
    assert [d.index for d in s._devices] == [1, 2]


def test_monitor_stamps_events_with_step() -> None:
    """The HardwareMonitor detector turns findings into hardware-sourced events at the step."""
    gpu = FakeGpu(temp=95.0)
    s, _, clock = sampler_for([gpu])
    monitor = HardwareMonitor(sampler=s)
    assert monitor.observe(step_stats(3)) == []
    clock.now += 1
    s.sample_once()
    (ev,) = monitor.observe(step_stats(4, rank=2))
    assert (ev.kind, ev.rank, ev.step, ev.source, ev.severity) == (
        "gpu_thermal",
        2,
        4,
        "hardware",
        "critical",
    )
    assert ev.details["gpu"] == 0 and ev.details["uuid"] == "GPU-0"


def test_monitor_as_event_source() -> None:
    """Drained once per step as a GuardConfig event source, events carry the step count."""
    gpu = FakeGpu()
    s, _, clock = sampler_for([gpu])
    source = HardwareMonitor(sampler=s, rank=1)
    assert source.drain() == [] and source.drain() == []
    gpu.temp = 99.0
    clock.now += 1
    s.sample_once()
    (ev,) = source.drain()
    assert (ev.kind, ev.rank, ev.step, ev.tick) == ("gpu_thermal", 1, 2, 2)


def test_singleton_thread_shared_and_sampling() -> None:
    """get_sampler returns one started sampler per process; its thread samples on its own."""
    fake = FakeNvml([FakeGpu(temp=95.0)])
    a = get_sampler(nvml_lib=fake, interval_s=0.01)
    b = get_sampler()
    assert a is b and a.available
    m1, m2 = HardwareMonitor(), HardwareMonitor()
    m1.observe(step_stats(0))
    m2.observe(step_stats(0))
    deadline = time.monotonic() + 5
    got1: list[Any] = []
    got2: list[Any] = []
    while time.monotonic() < deadline and not (got1 and got2):
        time.sleep(0.02)
        got1 += m1.observe(step_stats(1))
        got2 += m2.observe(step_stats(1))
    assert [e.kind for e in got1] == [e.kind for e in got2] == ["gpu_thermal"]
    stop_sampler()
    assert fake.shutdown


def test_no_driver_logs_one_line_and_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an NVIDIA driver (this machine) the sampler says so once and drains nothing."""
    lines: list[str] = []

    class Capture:
        def info(self, msg: str, **kw: Any) -> None:
            lines.append(msg)

        warning = info

    monkeypatch.setattr(hardware, "log", Capture())
    monkeypatch.setattr(hardware, "_cuda_works", lambda: False)

    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise FakeNVMLError("NVML Shared Library Not Found")

    get_sampler(nvml_lib=NoDriver([]))
    monitors = [HardwareMonitor() for _ in range(3)]
    assert all(m.observe(step_stats(i)) == [] for i, m in enumerate(monitors))
    assert len(lines) == 1 and "off" in lines[0]
    assert not get_sampler().available


def test_real_pynvml_here_is_off() -> None:
    """With the real pynvml on a machine without a driver, monitoring is simply off."""
    pytest.importorskip("pynvml")
    s = HardwareSampler()
    if s.open():  # a GPU machine: nothing to assert about absence
        s.stop()
        pytest.skip("an NVIDIA driver is present")
    assert s.reason and not s.available


def test_gpu_health_is_pure() -> None:
    """GpuHealth judges plain readings: the same numbers give the same findings."""
    h = GpuHealth()
    assert h.update(GpuReading(index=0, ts=0.0, temperature_c=90.0))[0].kind == "gpu_thermal"
