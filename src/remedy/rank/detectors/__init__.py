"""Anomaly detectors that run inside each training process.

Every detector is a small object with a `name`, `observe(stats)` and
`reset()` (some also `inspect_batch(batch)`); every threshold is a dataclass
field with a default, so `GuardConfig(detectors=[...])` can change any of
them. `default_detectors()` is the suite a Guard runs when told nothing.
The straggler check is not among them: it judges all ranks together and
runs in the supervisor (`remedy.control.straggler`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remedy.rank.detectors.base import Detector, DetectorSuite, event
from remedy.rank.detectors.collective import (
    CollectiveSlowDetector,
    CollectiveTimer,
    install_collective_timer,
)
from remedy.rank.detectors.data_stall import DataStallDetector
from remedy.rank.detectors.duplicates import DuplicateSamplesDetector
from remedy.rank.detectors.gpu_health import GpuHealth, GpuReading, GpuThresholds
from remedy.rank.detectors.hardware_monitor import HardwareMonitor
from remedy.rank.detectors.learning import LearningDetector
from remedy.rank.detectors.loss import LossSpikeDetector
from remedy.rank.detectors.loss_trend import LossDivergenceDetector, LossOscillationDetector
from remedy.rank.detectors.memory import (
    MemoryFragmentationDetector,
    MemoryGrowthDetector,
    MemoryPressureDetector,
)
from remedy.rank.detectors.numerics import GradNormDetector, NonFiniteDetector
from remedy.rank.detectors.padding import PaddingRatioDetector
from remedy.rank.detectors.scaler import ScalerCollapseDetector, ScalerOverflowDetector
from remedy.rank.detectors.update_stall import UpdateStallDetector

if TYPE_CHECKING:
    import torch

__all__ = [
    "CollectiveSlowDetector",
    "CollectiveTimer",
    "DataStallDetector",
    "Detector",
    "DetectorSuite",
    "DuplicateSamplesDetector",
    "GpuHealth",
    "GpuReading",
    "GpuThresholds",
    "GradNormDetector",
    "HardwareMonitor",
    "LearningDetector",
    "LossDivergenceDetector",
    "LossOscillationDetector",
    "LossSpikeDetector",
    "MemoryFragmentationDetector",
    "MemoryGrowthDetector",
    "MemoryPressureDetector",
    "NonFiniteDetector",
    "PaddingRatioDetector",
    "ScalerCollapseDetector",
    "ScalerOverflowDetector",
    "UpdateStallDetector",
    "default_detectors",
    "event",
    "install_collective_timer",
]


def default_detectors(
    model: torch.nn.Module | None = None,
    *,
    collective_timer: CollectiveTimer | None = None,
    pad_id: int | None = None,
    hardware: bool = True,
) -> list[Detector]:
    """The detectors a Guard runs when its config names none, with their default thresholds.

    A few need something the step numbers do not carry and stay silent
    without it: `update_stall` needs the `model`, `collective_slow` the
    timer from `install_collective_timer`, `padding_ratio` an attention mask
    in the batch or a `pad_id`. `hardware=False` leaves the NVML monitor out.
    """
    detectors: list[Detector] = [
        NonFiniteDetector(),
        GradNormDetector(),
        LossSpikeDetector(),
        LossDivergenceDetector(),
        LossOscillationDetector(),
        UpdateStallDetector(model),
        ScalerOverflowDetector(),
        ScalerCollapseDetector(),
        LearningDetector(),
        MemoryGrowthDetector(),
        MemoryPressureDetector(),
        MemoryFragmentationDetector(),
        DataStallDetector(),
        PaddingRatioDetector(pad_id=pad_id),
        DuplicateSamplesDetector(pad_id=pad_id),
        CollectiveSlowDetector(collective_timer),
    ]
    if hardware:
        detectors.append(HardwareMonitor())
    return detectors
