"""The closed vocabularies that policies, workers and the supervisor share.

These names are user-facing contracts (policy files, dashboards and tests
depend on them); add to them, never rename.
"""

from __future__ import annotations

from typing import Final

ANOMALY_KINDS: Final[tuple[str, ...]] = (
    "nonfinite_loss",
    "nonfinite_grad",
    "grad_norm_explosion",
    "grad_norm_vanishing",
    "loss_spike",
    "loss_divergence",
    "loss_oscillation",
    "update_stall",
    "scaler_overflow",
    "scaler_collapse",
    "memory_growth",
    "memory_pressure",
    "memory_fragmentation",
    "oom",
    "kv_fragmentation",
    "data_stall",
    "padding_ratio",
    "duplicate_samples",
    "collective_slow",
    "rank_hang",
    "rank_dead",
    "straggler",
    "gpu_thermal",
    "gpu_throttle",
    "gpu_ecc",
    "gpu_util_drop",
    "pcie_throughput_drop",
    "nvlink_error",
    "checkpoint_corrupt",
)

ACTIONS: Final[tuple[str, ...]] = (
    "rollback",
    "shrink_lr",
    "rescale_grad_scaler",
    "enable_activation_checkpointing",
    "switch_kv_allocator",
    "restart_rank",
    "skip_batches",
    "reduce_microbatch",
    "checkpoint_now",
    "dump_diagnostics",
    "notify",
    "abort",
    # Beyond the original set: CUDA caching-allocator settings at run time.
    "configure_cuda_allocator",
)

# Actions that interrupt training for every rank; at most one is in flight.
DISRUPTIVE_ACTIONS: Final[frozenset[str]] = frozenset({"rollback", "restart_rank"})

# Actions the supervisor carries out itself rather than sending to ranks.
SUPERVISOR_ACTIONS: Final[frozenset[str]] = frozenset({"restart_rank", "notify", "abort"})

SEVERITIES: Final[tuple[str, ...]] = ("info", "warning", "critical")

# Where an event came from: a worker-side detector, the supervisor's own
# watchers (heartbeats, hangs), the hardware sampler, or a chaos injector
# reporting what it did.
SOURCES: Final[tuple[str, ...]] = ("detector", "supervisor", "hardware", "chaos")

OUTCOMES: Final[tuple[str, ...]] = ("applied", "failed", "dry_run", "suppressed", "escalated")


def severity_rank(severity: str) -> int:
    """Order severities so that policies can say `severity: warning` meaning "at least"."""
    return SEVERITIES.index(severity)
