"""The closed vocabularies that policies, workers and the supervisor share.

These names are user-facing contracts (policy files, dashboards and tests
depend on them); add to them, never rename.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

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
    # A whole Ray node is gone (Ray's GCS calls it dead): one event for each of its
    # ranks, found together, with `details["node"]` naming it.
    "node_lost",
    "straggler",
    "gpu_thermal",
    "gpu_throttle",
    "gpu_ecc",
    "gpu_util_drop",
    "pcie_throughput_drop",
    "nvlink_error",
    "checkpoint_corrupt",
    # Silent data corruption: data-parallel replicas whose parameters or optimizer
    # state no longer agree (`workers.replicas`), and the answer of a `replay_step`
    # (`workers.replay`): the same numbers again (data or numerics), different
    # numbers on the re-run (a transient hardware fault), or a rank whose result a
    # peer does not reproduce from the same state and batch (that rank's chip).
    "replica_divergence",
    "replay_reproducible",
    "replay_transient",
    "replay_rank_specific",
    "checkpoint_write_failed",
    # A run that stopped learning: updates skipped, gradients identically zero or the
    # loss scale below its floor for many steps in a row (`rank.detectors.learning`).
    "learning_stopped",
    # A rank stayed in a phase of its own (an eval, a save, the time between its steps:
    # `rank.loop.phases`) past that phase's bound; `details["phase"]` names it.
    "phase_overrun",
)


@dataclass(frozen=True)
class ActionSpec:
    """One row of the action table: the one place an action is described.

    `applies`: where it is carried out: `rank` (an in-process applier in
    `remedy.rank.actions.inprocess.APPLIERS`, at a step boundary on every rank),
    `supervisor` (by the supervisor itself; `abort` also stops every rank's
    loop through its applier) or `group` (on the worker group).
    `disruptive`: interrupts training for every rank; at most one in flight.
    `does`: what it does, one phrase (the README's table, `remedy policy` messages).
    `under_callbacks`: None if the HF/Lightning callbacks apply it, else why not:
    the sentence a failed outcome gives there. Its parameter model is the entry
    of the same name in `_params.ACTION_PARAMS` (checked there at import).
    """

    name: str
    applies: Literal["rank", "supervisor", "group"]
    does: str
    disruptive: bool = False
    under_callbacks: str | None = None


ACTION_TABLE: Final[tuple[ActionSpec, ...]] = (
    ActionSpec(
        "rollback",
        "rank",
        "restore the newest snapshot or checkpoint `steps_back` before the anomaly, then "
        "skip `skip_batches` batches",
        disruptive=True,
    ),
    ActionSpec(
        "shrink_lr", "rank", "multiply every LR by `factor` from now on, under any schedule"
    ),
    ActionSpec(
        "rescale_grad_scaler", "rank", "set or multiply the AMP loss scale; retune its growth"
    ),
    ActionSpec(
        "enable_activation_checkpointing",
        "rank",
        "recompute the chosen modules' activations in backward instead of storing them",
    ),
    ActionSpec("switch_kv_allocator", "rank", "move live KV caches to another allocator"),
    ActionSpec(
        "restart_rank",
        "group",
        "replace the hung or dead rank; the others regroup and adopt one state",
        disruptive=True,
    ),
    ActionSpec("skip_batches", "rank", "drop the next `count` batches' updates"),
    ActionSpec(
        "reduce_microbatch",
        "rank",
        "split each batch into `factor` times more micro-batches (same global batch)",
        under_callbacks=(
            "the framework splits the batch itself (its gradient accumulation setting): "
            "reduce_microbatch cannot change that under a callback"
        ),
    ),
    ActionSpec(
        "checkpoint_now",
        "rank",
        "write a durable checkpoint at the next boundary",
        under_callbacks=(
            "the framework writes its own checkpoints: remedy keeps no durable checkpoint "
            "under a callback"
        ),
    ),
    ActionSpec("dump_diagnostics", "rank", "write per-module gradient norms and recent step stats"),
    ActionSpec("notify", "supervisor", "tell a person (the decision's reason by default)"),
    ActionSpec("abort", "supervisor", "stop the run (exit status 3) with `reason`"),
    # Beyond the original set: CUDA caching-allocator settings at run time.
    ActionSpec(
        "configure_cuda_allocator",
        "rank",
        "change the CUDA caching allocator's settings (e.g. expandable_segments)",
    ),
    ActionSpec(
        "replay_step",
        "rank",
        "re-run the anomalous step from the state just before it, on its rank and on a peer, "
        "and answer replay_reproducible, replay_transient or replay_rank_specific",
        disruptive=True,
        under_callbacks=(
            "the framework runs the step itself: remedy cannot re-run it from the state "
            "before it under a callback"
        ),
    ),
)
ACTION_SPECS: Final[dict[str, ActionSpec]] = {a.name: a for a in ACTION_TABLE}

ACTIONS: Final[tuple[str, ...]] = tuple(ACTION_SPECS)

# Actions that interrupt training for every rank; at most one is in flight.
DISRUPTIVE_ACTIONS: Final[frozenset[str]] = frozenset(a.name for a in ACTION_TABLE if a.disruptive)

# Actions the supervisor carries out itself rather than sending to ranks.
SUPERVISOR_ACTIONS: Final[frozenset[str]] = frozenset(
    a.name for a in ACTION_TABLE if a.applies != "rank"
)

SEVERITIES: Final[tuple[str, ...]] = ("info", "warning", "critical")

# Where an event came from: a worker-side detector, the supervisor's own
# watchers (heartbeats, hangs), the hardware sampler, or a chaos injector
# reporting what it did.
SOURCES: Final[tuple[str, ...]] = ("detector", "supervisor", "hardware", "chaos")

OUTCOMES: Final[tuple[str, ...]] = ("applied", "failed", "dry_run", "suppressed", "escalated")


def severity_rank(severity: str) -> int:
    """Order severities so that policies can say `severity: warning` meaning "at least"."""
    return SEVERITIES.index(severity)
