"""remedy: auto-remediation supervisor for long PyTorch training jobs on Ray.

The one import a training script needs::

    from remedy import Guard, GuardConfig, get_context

The three parts live in subpackages: `remedy.workers` (inside each training
process), `remedy.policies` (the policy language; pure Python) and
`remedy.supervisor` (the Ray side and the CLI). Names here are loaded on
first use, so `import remedy.policies` pulls in neither torch nor Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remedy._lazy import exports

if TYPE_CHECKING:
    from remedy.policies import AnomalyEvent, Decision, Engine, PolicyError, load_policy
    from remedy.workers import (
        Guard,
        GuardConfig,
        StepResult,
        WorkerContext,
        get_context,
        load_chaos,
    )

_EXPORTS = {
    "Guard": "remedy.workers",
    "GuardConfig": "remedy.workers",
    "StepResult": "remedy.workers",
    "WorkerContext": "remedy.workers",
    "get_context": "remedy.workers",
    "load_chaos": "remedy.workers",
    "AnomalyEvent": "remedy.policies",
    "Decision": "remedy.policies",
    "Engine": "remedy.policies",
    "PolicyError": "remedy.policies",
    "load_policy": "remedy.policies",
}

__all__ = [
    "AnomalyEvent",
    "Decision",
    "Engine",
    "Guard",
    "GuardConfig",
    "PolicyError",
    "StepResult",
    "WorkerContext",
    "get_context",
    "load_chaos",
    "load_policy",
]


__getattr__, __dir__ = exports("remedy", _EXPORTS, globals())
