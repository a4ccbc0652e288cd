"""remedy's worker side: everything that runs inside a training process.

The `Guard` wraps the user's model, optimizer, scheduler, scaler and data,
measures each step, runs the detectors, and applies commands at step
boundaries. It imports neither Ray nor the supervisor: with no supervisor
attached it runs the policy engine in-process (single-process mode).
"""

from remedy.workers.chaos import Fault, FaultInjector, load_chaos
from remedy.workers.commands import Command, Outcome
from remedy.workers.context import WorkerContext, get_context, set_context
from remedy.workers.guard import Guard, GuardConfig, StepResult
from remedy.workers.snapshots import Snapshot, SnapshotRing
from remedy.workers.stats import StepStats

__all__ = [
    "Command",
    "Fault",
    "FaultInjector",
    "Guard",
    "GuardConfig",
    "Outcome",
    "Snapshot",
    "SnapshotRing",
    "StepResult",
    "StepStats",
    "WorkerContext",
    "get_context",
    "load_chaos",
    "set_context",
]
