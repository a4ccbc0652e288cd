"""Anomaly detectors that run inside each training process."""

from workers.detectors.base import Detector, DetectorSuite, event
from workers.detectors.loss import LossSpikeDetector
from workers.detectors.numerics import GradNormDetector, NonFiniteDetector

__all__ = [
    "Detector",
    "DetectorSuite",
    "GradNormDetector",
    "LossSpikeDetector",
    "NonFiniteDetector",
    "default_detectors",
    "event",
]


def default_detectors() -> list[Detector]:
    """The detectors a Guard runs when its config names none."""
    return [NonFiniteDetector(), GradNormDetector(), LossSpikeDetector()]
