"""The NVML sampler: one background thread per process reading the local GPUs about once a second.

Everything NVML is behind `Nvml`, a small adapter over the handful of
`pynvml` functions remedy calls, so a test can hand it a fake module (no GPU
exists on the CI machines). A metric a GPU does not support is asked for
once and then left alone.

`get_sampler()` returns the process-wide `HardwareSampler`, started on first
use under a lock, so several Guards in one process share one thread. It
watches the GPUs this process may use (`CUDA_VISIBLE_DEVICES`, by index or
UUID; all GPUs when unset), so the ranks on a node cover each GPU once.
Each reading goes through a `GpuHealth` (workers.detectors.gpu_health); the
findings are queued for every subscriber, and `HardwareMonitor` (a detector)
stamps them with the rank and step. Where no NVIDIA driver is present the
sampler logs one line and stays off: subscribers drain nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from remedy.rank.detectors.gpu_health import Finding, GpuHealth, GpuReading, GpuThresholds

log = structlog.get_logger("remedy.hardware")

# NVML enum values (nvml.h); fixed by the driver ABI, so a fake module need not define them.
_TEMPERATURE_GPU = 0
_ECC_CORRECTED, _ECC_UNCORRECTED, _VOLATILE_ECC = 0, 1, 0
_PCIE_TX, _PCIE_RX = 0, 1
_NVLINK_COUNTERS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}
_NVLINK_MAX_LINKS = 18


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str | None
    nvlinks: list[int]


class Nvml:
    """The NVML calls remedy makes, over `lib` (the `pynvml` module or a test double)."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self._unsupported: set[tuple[int, str]] = set()

    def open(self) -> list[_Device]:
        """Initialise NVML and find the GPUs this process may use."""
        lib = self.lib
        lib.nvmlInit()
        count = int(lib.nvmlDeviceGetCount())
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        wanted = (
            [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else None
        )
        devices = []
        for index in range(count):
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            uuid = self._call(index, "uuid", lib.nvmlDeviceGetUUID, handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            if wanted is not None and str(index) not in wanted and uuid not in wanted:
                continue
            devices.append(_Device(index, handle, uuid, self._active_links(index, handle)))
        return devices

    def _active_links(self, index: int, handle: Any) -> list[int]:
        links = []
        for link in range(_NVLINK_MAX_LINKS):
            try:
                if self.lib.nvmlDeviceGetNvLinkState(handle, link):
                    links.append(link)
            except self.lib.NVMLError:
                break  # no such link (or no NVLink at all)
        return links

    def _call(self, index: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, or None where the GPU does not support it (asked once)."""
        if (index, what) in self._unsupported:
            return None
        try:
            return fn(*args)
        except self.lib.NVMLError:
            self._unsupported.add((index, what))
            return None

    def read(self, dev: _Device, *, now: float, active: bool) -> GpuReading:
        lib, i, h = self.lib, dev.index, dev.handle
        reasons = self._call(i, "clocks", lib.nvmlDeviceGetCurrentClocksEventReasons, h)
        util = self._call(i, "util", lib.nvmlDeviceGetUtilizationRates, h)
        tx = self._call(i, "pcie_tx", lib.nvmlDeviceGetPcieThroughput, h, _PCIE_TX)
        rx = self._call(i, "pcie_rx", lib.nvmlDeviceGetPcieThroughput, h, _PCIE_RX)
        nvlink: dict[str, int] | None = None
        if dev.nvlinks:
            nvlink = {}
            for link in dev.nvlinks:
                for name, counter in _NVLINK_COUNTERS.items():
                    key = f"link{link}.{name}"
                    got = self._call(i, key, lib.nvmlDeviceGetNvLinkErrorCounter, h, link, counter)
                    if got is not None:
                        nvlink[key] = int(got)
        return GpuReading(
            index=i,
            ts=now,
            active=active,
            uuid=dev.uuid,
            temperature_c=self._call(i, "temp", lib.nvmlDeviceGetTemperature, h, _TEMPERATURE_GPU),
            throttle_reasons=reasons,
            ecc_corrected=self._call(
                i, "ecc_c", lib.nvmlDeviceGetTotalEccErrors, h, _ECC_CORRECTED, _VOLATILE_ECC
            ),
            ecc_uncorrected=self._call(
                i, "ecc_u", lib.nvmlDeviceGetTotalEccErrors, h, _ECC_UNCORRECTED, _VOLATILE_ECC
            ),
            util_pct=None if util is None else float(util.gpu),
            pcie_kbps=None if tx is None or rx is None else float(tx + rx),
            pcie_width=self._call(i, "width", lib.nvmlDeviceGetCurrPcieLinkWidth, h),
            pcie_max_width=self._call(i, "max_width", lib.nvmlDeviceGetMaxPcieLinkWidth, h),
            nvlink_errors=nvlink,
        )

    def close(self) -> None:
        with contextlib.suppress(self.lib.NVMLError):
            self.lib.nvmlShutdown()


class Subscription:
    """One consumer's queue of findings, and its word that training is progressing."""

    def __init__(self, sampler: HardwareSampler) -> None:
        self._sampler = sampler
        self._queue: deque[tuple[int, str | None, Finding]] = deque(maxlen=1000)
        self._lock = threading.Lock()

    def note_activity(self) -> None:
        """Called each step: readings taken while steps progress count as "training"."""
        self._sampler.last_activity = time.monotonic()

    def push(self, item: tuple[int, str | None, Finding]) -> None:
        with self._lock:
            self._queue.append(item)

    def drain(self) -> list[tuple[int, str | None, Finding]]:
        """(GPU index, GPU UUID, finding) for each finding since the last drain."""
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out


class HardwareSampler:
    """Samples every watched GPU each `interval_s` and queues the findings for subscribers."""

    def __init__(
        self,
        nvml_lib: Any = None,
        *,
        interval_s: float = 1.0,
        thresholds: GpuThresholds | None = None,
        active_window_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.thresholds = thresholds or GpuThresholds()
        self.active_window_s = active_window_s
        self.clock = clock
        self.last_activity = float("-inf")
        self.available = False
        self.reason = ""
        self._lib = nvml_lib
        self._nvml: Nvml | None = None
        self._devices: list[_Device] = []
        self._health: dict[int, GpuHealth] = {}
        self._subs: weakref.WeakSet[Subscription] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self) -> bool:
        """Find NVML and the GPUs; on failure log one line and stay off. True when on."""
        try:
            lib = self._lib
            if lib is None:
                import pynvml  # noqa: PLC0415 - only where hardware monitoring is wanted

                lib = pynvml
            self._nvml = Nvml(lib)
            self._devices = self._nvml.open()
        except Exception as exc:  # no driver, no library, no permission: all "off"
            self.reason = f"{type(exc).__name__}: {exc}"
            # Expected on a CPU machine (info); surprising where CUDA works (warning).
            say = log.warning if _cuda_works() else log.info
            say("hardware monitoring off: no NVIDIA driver or GPU found", nvml=self.reason)
            return False
        if not self._devices:
            self.reason = "no visible GPU"
            log.info("hardware monitoring off: NVML works but no GPU is visible to this process")
            return False
        self._health = {d.index: GpuHealth(self.thresholds) for d in self._devices}
        self.available = True
        log.info("hardware monitoring on", gpus=[d.index for d in self._devices])
        return True

    def start(self) -> None:
        """Open NVML and start the sampling thread (a daemon: it never holds the process)."""
        if self._thread is not None or not self.open():
            return
        self._thread = threading.Thread(target=self._run, name="remedy-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_once()
            except Exception:  # the sampler must never take training down
                log.exception("hardware sample failed")

    def sample_once(self) -> list[tuple[int, str | None, Finding]]:
        """Read every watched GPU once, judge the readings, queue and return the findings."""
        if self._nvml is None:
            return []
        now = self.clock()
        active = now - self.last_activity <= self.active_window_s
        found = []
        for dev in self._devices:
            reading = self._nvml.read(dev, now=now, active=active)
            found += [(dev.index, dev.uuid, f) for f in self._health[dev.index].update(reading)]
        if found:
            with self._lock:
                subs = list(self._subs)
            for sub in subs:
                for item in found:
                    sub.push(item)
        return found

    def subscribe(self) -> Subscription:
        sub = Subscription(self)
        with self._lock:
            self._subs.add(sub)
        return sub

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None
        self.available = False


def _cuda_works() -> bool:
    try:
        import torch  # noqa: PLC0415

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


_singleton_lock = threading.Lock()
_singleton: HardwareSampler | None = None


def get_sampler(**kwargs: Any) -> HardwareSampler:
    """The process-wide sampler, created and started on first call (later kwargs are ignored)."""
    global _singleton
    with _singleton_lock:
        if _singleton is None:
            _singleton = HardwareSampler(**kwargs)
            _singleton.start()
        return _singleton


def stop_sampler() -> None:
    """Stop and forget the process-wide sampler (tests; the end of a process)."""
    global _singleton
    with _singleton_lock:
        if _singleton is not None:
            _singleton.stop()
        _singleton = None
