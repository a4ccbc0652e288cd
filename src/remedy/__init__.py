"""remedy: auto-remediation supervisor for long PyTorch training jobs on Ray.

The one import a training script needs::

    from remedy import Guard, GuardConfig, get_context

The packages are cut by process: `remedy.rank` (inside each training
process), `remedy.supervisor` (the supervisor's Ray actor and the node
agents), `remedy.control` (the supervisor's pure control state),
`remedy.protocol` (what crosses between them), `remedy.cli`, `remedy.rundir`,
`remedy.report`, `remedy.integrations` and `remedy.policies` (the policy
language; pure Python). Names here are loaded on first use, so
`import remedy.policies` pulls in neither torch nor Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remedy._lazy import exports

if TYPE_CHECKING:
    from remedy.policies import AnomalyEvent, Decision, Engine, PolicyError, load_policy
    from remedy.rank import Guard, GuardConfig, StepResult, WorkerContext, get_context, load_chaos

_EXPORTS = {
    "Guard": "remedy.rank",
    "GuardConfig": "remedy.rank",
    "StepResult": "remedy.rank",
    "WorkerContext": "remedy.rank",
    "get_context": "remedy.rank",
    "load_chaos": "remedy.rank",
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
