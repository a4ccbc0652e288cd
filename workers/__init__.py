"""remedy's worker side: everything that runs inside a training process.

The `Guard` wraps the user's model, optimizer, scheduler, scaler and data,
measures each step, runs the detectors, and applies commands at step
boundaries. It imports neither Ray nor the supervisor: with no supervisor
attached it runs the policy engine in-process (single-process mode).

Names here are loaded on first use: the supervisor's decision core imports
the command records (`remedy.workers.commands`) and must not pull in torch
with the Guard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remedy._lazy import exports

if TYPE_CHECKING:
    from remedy.workers.chaos import Fault, FaultInjector, load_chaos
    from remedy.workers.commands import Command, Outcome
    from remedy.workers.context import WorkerContext, get_context, set_context
    from remedy.workers.guard import Guard, GuardConfig, StepResult
    from remedy.workers.snapshots import Snapshot, SnapshotRing
    from remedy.workers.stats import StepStats

_EXPORTS = {
    "Command": "remedy.workers.commands",
    "Fault": "remedy.workers.chaos",
    "FaultInjector": "remedy.workers.chaos",
    "Guard": "remedy.workers.guard",
    "GuardConfig": "remedy.workers.guard",
    "Outcome": "remedy.workers.commands",
    "Snapshot": "remedy.workers.snapshots",
    "SnapshotRing": "remedy.workers.snapshots",
    "StepResult": "remedy.workers.guard",
    "StepStats": "remedy.workers.stats",
    "WorkerContext": "remedy.workers.context",
    "get_context": "remedy.workers.context",
    "load_chaos": "remedy.workers.chaos",
    "set_context": "remedy.workers.context",
}

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


__getattr__, __dir__ = exports("remedy.workers", _EXPORTS, globals())
