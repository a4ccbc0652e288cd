"""Cheap per-step measurements: global gradient norm and memory in use."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class GradNorm:
    """The L2 norm over every gradient of a fixed list of parameters, as a device tensor.

    One `_foreach_norm` per device and dtype group (grouped once: grouping
    anew each step costs more than the norm of a small model); no host sync.
    A NaN or inf anywhere makes the result non-finite, which is how the Guard
    detects non-finite gradients.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        self._groups = list(groups.values())
        self._device = self._groups[0][0].device if self._groups else torch.device("cpu")

    def __call__(self) -> torch.Tensor:
        """L2 norm over every gradient, as a device tensor (no host sync)."""
        norms = []
        for group in self._groups:
            grads = [p.grad for p in group if p.grad is not None]
            if grads:
                # Half-precision norms are summed in float32 (fp16 gradients of 6e4 would
                # overflow to inf); asking for it on float32 gradients costs ~5% more.
                wide = None if grads[0].dtype in (torch.float32, torch.float64) else torch.float32
                per_tensor = torch._foreach_norm(grads, 2.0, dtype=wide)
                norms.append(torch.linalg.vector_norm(torch.stack(per_tensor), 2.0))
        if len(norms) == 1:
            return norms[0]
        if not norms:
            return torch.zeros((), device=self._device)
        total: torch.Tensor = torch.linalg.vector_norm(
            torch.stack([n.to(self._device) for n in norms]), 2.0
        )
        return total


def first_nonfinite_param(model: torch.nn.Module) -> str | None:
    """Qualified name of the first parameter whose gradient holds inf or NaN.

    Costs a sync per parameter, so it runs only after a non-finite norm was seen.
    """
    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return None


def module_grad_norms(model: torch.nn.Module) -> dict[str, float]:
    """Gradient norm per top-level-and-below module (for diagnosis, not every step)."""
    out: dict[str, float] = {}
    for name, module in model.named_modules():
        grads = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
        if grads:
            out[name or "<root>"] = float(
                torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            )
    return out


_statm: tuple[int, int] | None = None  # (pid, fd): reopened after a fork


def process_rss_bytes() -> int | None:
    """Resident set size of this process, from /proc (Linux); None elsewhere.

    The file stays open: opening it every step costs ~0.1 ms, reading ~7 us.
    """
    global _statm
    try:
        pid = os.getpid()
        if _statm is None or _statm[0] != pid:
            _statm = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY))
        return int(os.pread(_statm[1], 64, 0).split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class MemoryProbe:
    """(allocated, reserved, capacity) bytes of one device, cheap enough to read every step.

    On CUDA these are the caching allocator's counters and the device's total
    memory, plain reads. On CPU only the first is known: the resident set,
    from /proc, a system call that costs 25-40 us right after a step has
    freed its activations (the kernel is still unmapping them), so it is
    read at most once every `min_interval_s` and the last reading is
    returned in between: on 5 ms steps that is one read in four, on steps
    longer than the interval every step reads. The memory detectors look at
    trends over tens of steps, which a reading a few steps old does not change.
    """

    def __init__(self, device: torch.device, *, min_interval_s: float = 0.02) -> None:
        self.device = device
        self.min_interval_s = min_interval_s
        self._capacity: int | None = None
        self._rss: int | None = None
        self._read_at = -math.inf

    def read(self) -> tuple[int | None, int | None, int | None]:
        if self.device.type == "cuda":
            if self._capacity is None:
                self._capacity = torch.cuda.get_device_properties(self.device).total_memory
            return (
                torch.cuda.memory_allocated(self.device),
                torch.cuda.memory_reserved(self.device),
                self._capacity,
            )
        now = time.monotonic()
        if now - self._read_at >= self.min_interval_s:
            self._rss, self._read_at = process_rss_bytes(), now
        return self._rss, None, None
