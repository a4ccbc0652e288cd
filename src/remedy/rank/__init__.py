"""remedy's worker side: everything that runs inside a training process.

The `Guard` wraps the user's model, optimizer, scheduler, scaler and data,
measures each step, runs the detectors, and applies commands at step
boundaries. It imports neither Ray nor the supervisor: with no supervisor
attached it runs the policy engine in-process (single-process mode).

Names here are loaded on first use: the supervisor's decision core imports
the command records (`remedy.protocol.commands`) and must not pull in torch
with the Guard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remedy._lazy import exports

if TYPE_CHECKING:
    from remedy.protocol.commands import Command, Outcome
    from remedy.rank.chaos.faults import Fault, FaultInjector, load_chaos
    from remedy.rank.guard import Guard, GuardConfig, StepResult
    from remedy.rank.link.context import WorkerContext, get_context, set_context
    from remedy.rank.loop.stats import StepStats
    from remedy.rank.state.snapshots import Snapshot, SnapshotRing

_EXPORTS = {
    "Command": "remedy.protocol.commands",
    "Fault": "remedy.rank.chaos.faults",
    "FaultInjector": "remedy.rank.chaos.faults",
    "Guard": "remedy.rank.guard",
    "GuardConfig": "remedy.rank.guard",
    "Outcome": "remedy.protocol.commands",
    "Snapshot": "remedy.rank.state.snapshots",
    "SnapshotRing": "remedy.rank.state.snapshots",
    "StepResult": "remedy.rank.guard",
    "StepStats": "remedy.rank.loop.stats",
    "WorkerContext": "remedy.rank.link.context",
    "get_context": "remedy.rank.link.context",
    "load_chaos": "remedy.rank.chaos.faults",
    "set_context": "remedy.rank.link.context",
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


__getattr__, __dir__ = exports("remedy.rank", _EXPORTS, globals())
