"""In-process actions: what a rank does when a command reaches its step boundary.

Each applier is a function `(target, params, command) -> result` that changes
the running job in place and returns a JSON-able result for the journal. The
target is an `ActionTarget`: what a rank offers its appliers (the `Guard`,
or a framework callback's `LoopGuard`), not the whole of either.
An applier raises `ActionError` when the action cannot be done (the engine
then follows the rule's `on_failure`), or `TransientActionError` for
failures worth retrying; `apply_command` retries those with tenacity within
bounds before reporting failure.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import structlog
import torch
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from remedy.protocol.commands import Command, Outcome
from remedy.rank.actions import replay
from remedy.rank.exceptions import ActionError, CheckpointError, TransientActionError
from remedy.rank.state import restore_point

if TYPE_CHECKING:
    from remedy.rank.actions.remediation import Remediation
    from remedy.rank.loop.stats import StepStats
    from remedy.rank.state.checkpoint_store import CheckpointStore
    from remedy.rank.state.snapshots import Snapshot, SnapshotRing

log = structlog.get_logger("remedy.actions")


class ActionTarget(Protocol):
    """What the appliers of in-process actions may read and change on a rank."""

    # The remediations in force (LR cuts, micro-batch split, KV allocator and its live caches).
    remediation: Remediation

    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def scaler(self) -> Any: ...

    @property
    def snapshots(self) -> SnapshotRing:
        """The in-memory snapshots a rollback restores."""

    @property
    def rank(self) -> int: ...
    @property
    def step_count(self) -> int: ...
    @property
    def tick(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def run_dir(self) -> Path | None: ...
    @property
    def checkpoints(self) -> CheckpointStore | None: ...
    @property
    def group(self) -> Any:
        """The process group the ranks agree through, or None for one rank."""

    @property
    def data_rewindable(self) -> bool:
        """Whether a rollback can take the data back too."""

    @property
    def lr_scale(self) -> float: ...
    @property
    def recent_stats(self) -> Iterable[StepStats]: ...

    def refusal(self, action: str) -> str | None:
        """Why this loop cannot apply `action` (one sentence), or None when it can."""

    def restore(
        self, snap: Snapshot, *, agree: Callable[[str | None], str] | None = None
    ) -> None: ...
    def skip_next(self, count: int) -> list[int]: ...
    def effective_lrs(self) -> list[float]: ...
    def scale_lr(self, factor: float, *, min_lr: float = 0.0) -> None: ...
    def take_snapshot(self) -> Snapshot: ...
    def checkpoint_extra(self) -> dict[str, Any]: ...
    def module_grad_norms(self) -> dict[str, float]: ...
    def request_stop(self, reason: str) -> None: ...


Applier = Callable[[ActionTarget, dict[str, Any], Command], dict[str, Any]]
APPLIERS: dict[str, Applier] = {}

# Bounds on retrying a transient failure; a command that still fails is
# reported as failed and the policy escalates.
MAX_ATTEMPTS = 3
RETRY_WAIT_S = (0.05, 1.0)


def applier(name: str) -> Callable[[Applier], Applier]:
    def register(fn: Applier) -> Applier:
        APPLIERS[name] = fn
        return fn

    return register


def apply_command(guard: ActionTarget, command: Command) -> Outcome:
    """Apply one command with bounded retries; never raises (errors become a failed outcome)."""
    fn = APPLIERS.get(command.action)
    step, tick = guard.step_count, guard.tick
    refused = guard.refusal(command.action)
    if fn is None or refused is not None:
        return Outcome(
            command.decision_id,
            guard.rank,
            "failed",
            step,
            tick,
            refused or f"{command.action!r} is not an in-process action",
        )
    attempts = 0
    try:
        for attempt in Retrying(
            stop=stop_after_attempt(MAX_ATTEMPTS),
            wait=wait_exponential(min=RETRY_WAIT_S[0], max=RETRY_WAIT_S[1]),
            retry=retry_if_exception_type(TransientActionError),
            reraise=True,
        ):
            with attempt:
                attempts = attempt.retry_state.attempt_number
                result = fn(guard, dict(command.params), command)
    except ActionError as exc:
        log.warning(
            "action_failed", action=command.action, decision_id=command.decision_id, error=str(exc)
        )
        return Outcome(
            command.decision_id, guard.rank, "failed", step, tick, str(exc), attempts=attempts
        )
    except Exception as exc:  # an applier bug must not kill the training step
        log.exception("action_crashed", action=command.action, decision_id=command.decision_id)
        return Outcome(
            command.decision_id,
            guard.rank,
            "failed",
            step,
            tick,
            f"{type(exc).__name__}: {exc}",
            attempts=attempts,
        )
    return Outcome(
        command.decision_id,
        guard.rank,
        "applied",
        step,
        tick,
        result.pop("detail", ""),
        result,
        attempts,
    )


@applier("rollback")
def rollback(guard: ActionTarget, params: dict[str, Any], command: Command) -> dict[str, Any]:
    """Restore the newest state at least `steps_back` before the anomaly, then skip batches.

    From the snapshot ring when it reaches back that far (every rank's ring
    holds the same steps: the same cadence, and a restart resets every ring
    to one adopted state), else from the newest durable checkpoint every
    rank holds a good copy of: the ranks agree through the process group
    (`restore_point`), the one collective a rollback may run. Checkpoints
    newer than the restored step are retired: their timeline is abandoned.
    """
    steps_back = int(params.get("steps_back", 100))
    target = max(command.anomaly_step - steps_back, 0)
    wanted, older = str(params.get("source", "auto")), int(params.get("older", 0))
    if wanted == "disk":
        # The escalation ladder asks for a durable checkpoint on purpose (the in-memory
        # rollback did not cure the incident): no fallback to the ring.
        return _rollback_from_disk(guard, params, target, older)
    snap, source, why = guard.snapshots.newest_at_or_before(target), "memory", ""
    if snap is None and guard.checkpoints is not None and wanted == "auto":
        choice = restore_point.agree_on_disk(
            guard.checkpoints, at_or_before=target, group=guard.group
        )
        why = choice.describe()
        if choice.step is not None:
            snap, source = _load_agreed(guard.checkpoints, choice.step), "disk"
    if snap is None:
        # Nothing that far back: the newest state from before the anomaly still beats going on.
        snap, source = guard.snapshots.newest_at_or_before(command.anomaly_step), "memory"
    if snap is None:
        raise ActionError(
            f"no snapshot or checkpoint at or before step {command.anomaly_step} to roll back to"
            + (f" ({why})" if why else "")
        )
    return _restored(guard, params, snap, source, why, target)


def _rollback_from_disk(
    guard: ActionTarget, params: dict[str, Any], target: int, older: int
) -> dict[str, Any]:
    """`rollback` with `source: disk`: the newest durable checkpoint at or before `target` good
    on every rank, or `older` good ones before it."""
    if guard.checkpoints is None:
        raise ActionError(
            "a rollback to a durable checkpoint needs remedy's checkpoint store; this loop has "
            "none (no run directory, checkpoint_every 0, or a framework that keeps its own)"
        )
    choice = restore_point.agree_on_disk(
        guard.checkpoints, at_or_before=target, group=guard.group, older=older
    )
    why = choice.describe()
    if choice.step is None:
        which = f"{older + 1} good durable checkpoints" if older else "a good durable checkpoint"
        raise ActionError(
            f"no {which} at or before step {target} on every rank" + (f" ({why})" if why else "")
        )
    snap = _load_agreed(guard.checkpoints, choice.step)
    if older:
        why = (why + "; " if why else "") + f"passed over the {older} newest good one(s)"
    return _restored(guard, params, snap, "disk", why, target)


def _load_agreed(checkpoints: CheckpointStore, step: int) -> Snapshot:
    """The checkpoint of `step`, which every rank verified; ActionError if it changed since
    (no agreed state to restore)."""
    try:
        return checkpoints.load(step)
    except CheckpointError as exc:
        raise ActionError(f"checkpoint at step {step} became unreadable: {exc}") from exc


def _restored(
    guard: ActionTarget, params: dict[str, Any], snap: Snapshot, source: str, why: str, target: int
) -> dict[str, Any]:
    """Restore `snap` (from `source`), retire the newer checkpoints, skip batches; the result."""
    from_step = guard.step_count
    # Every rank of a group restores or none does: a user's object that refuses its state
    # on one rank must not leave that rank alone at the old step (`restore_point`).
    group = guard.group
    agree = None if group is None else partial(restore_point.failed_elsewhere, group=group)
    guard.restore(snap, agree=agree)
    retired = guard.checkpoints.retire_after(snap.step) if guard.checkpoints is not None else []
    skipped = guard.skip_next(int(params.get("skip_batches", 0)))
    rewound = guard.data_rewindable
    # The policy's reason says how far back it asked to go; the snapshot ring decides
    # where it can: say the step restored and how far that really was.
    detail = (
        f"restored step {snap.step} from {source} ({from_step - snap.step} steps back, "
        f"from step {from_step}); skipped {len(skipped)} batches"
    )
    if why:
        detail += f"; {why}"
    if retired:
        detail += (
            f"; retired the checkpoints of steps {', '.join(map(str, retired))} "
            "(their timeline is abandoned)"
        )
    if not rewound:
        detail += (
            "; the data was not rewound (a plain iterable, or a framework's own loader, "
            "cannot go back): training goes on with the next batch it yields"
        )
    return {
        "from_step": from_step,
        "restored_step": snap.step,
        "steps_back": from_step - snap.step,
        "target_step": target,
        "source": source,
        "data_rewound": rewound,
        **skipped_result(skipped),
        "retired_checkpoints": retired,
        "detail": detail,
    }


@applier("skip_batches")
def skip_batches(guard: ActionTarget, params: dict[str, Any], command: Command) -> dict[str, Any]:
    skipped = guard.skip_next(int(params.get("count", 1)))
    return {**skipped_result(skipped), "detail": f"skipped {len(skipped)} batches"}


# Skipped batch indices an outcome lists one by one; more go as ranges (an outcome's result
# is bounded: 300 indices, llm-pretrain's skip, made it too big for the supervisor to take).
LISTED_SKIPS = 64


def skipped_result(skipped: list[int]) -> dict[str, Any]:
    """The skipped batch indices for an outcome: `skipped_count`, and `skipped_batches` (the
    indices) when there are at most `LISTED_SKIPS`, else `skipped_ranges` ([first, last] each)."""
    out: dict[str, Any] = {"skipped_count": len(skipped)}
    if len(skipped) <= LISTED_SKIPS:
        out["skipped_batches"] = skipped
        return out
    ranges: list[list[int]] = []
    for index in sorted(skipped):
        if ranges and index == ranges[-1][1] + 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    out["skipped_ranges"] = ranges
    return out


@applier("shrink_lr")
def shrink_lr(guard: ActionTarget, params: dict[str, Any], command: Command) -> dict[str, Any]:
    """Cut every LR by `factor` (floored at `min_lr`) from now on, under any schedule."""
    factor = float(params.get("factor", 0.5))
    min_lr = float(params.get("min_lr", 0.0))
    if not 0 < factor <= 1:
        raise ActionError(f"shrink_lr factor must be in (0, 1], got {factor}")
    before = guard.effective_lrs()
    guard.scale_lr(factor, min_lr=min_lr)
    after = guard.effective_lrs()
    return {
        "lr_before": before,
        "lr_after": after,
        "lr_scale": guard.lr_scale,
        "detail": (
            f"lr {before[0]:.3g} -> {after[0]:.3g}; every later LR of the schedule "
            f"x{guard.lr_scale:.3g}"
        ),
    }


@applier("rescale_grad_scaler")
def rescale_grad_scaler(
    guard: ActionTarget, params: dict[str, Any], command: Command
) -> dict[str, Any]:
    """Set or multiply the GradScaler's scale; optionally change its growth settings."""
    scaler = guard.scaler
    if scaler is None or not scaler.is_enabled():
        raise ActionError("rescale_grad_scaler needs an enabled GradScaler; this job has none")
    before = float(scaler.get_scale())
    new = before
    if params.get("scale") is not None:
        new = float(params["scale"])
    if params.get("factor") is not None:
        new *= float(params["factor"])
    if new != before:
        scaler.update(
            new_scale=torch.tensor(new, dtype=torch.float32, device=_scaler_device(scaler))
        )
    if params.get("growth_interval") is not None:
        scaler.set_growth_interval(int(params["growth_interval"]))
    if params.get("growth_factor") is not None:
        scaler.set_growth_factor(float(params["growth_factor"]))
    if params.get("backoff_factor") is not None:
        scaler.set_backoff_factor(float(params["backoff_factor"]))
    return {
        "scale_before": before,
        "scale_after": float(scaler.get_scale()),
        "detail": f"scale {before:g} -> {new:g}",
    }


def _scaler_device(scaler: torch.amp.GradScaler) -> str:
    scale = getattr(scaler, "_scale", None)
    return (
        str(scale.device)
        if isinstance(scale, torch.Tensor)
        else str(getattr(scaler, "_device", "cpu"))
    )


@applier("checkpoint_now")
def checkpoint_now(guard: ActionTarget, params: dict[str, Any], command: Command) -> dict[str, Any]:
    if guard.checkpoints is None:
        raise ActionError("checkpoint_now needs a run directory for durable checkpoints")
    snap = guard.take_snapshot()
    snap.extra = guard.checkpoint_extra()
    try:
        path = guard.checkpoints.save_now(snap)
    except CheckpointError as exc:  # retried within bounds by the store already
        raise ActionError(str(exc)) from exc
    return {"path": str(path), "step": snap.step, "detail": f"checkpoint at step {snap.step}"}


@applier("dump_diagnostics")
def dump_diagnostics(
    guard: ActionTarget, params: dict[str, Any], command: Command
) -> dict[str, Any]:
    """Write per-module gradient norms and recent stats for a person to read."""
    if guard.run_dir is None:
        raise ActionError("dump_diagnostics needs a run directory")
    out = guard.run_dir / "diagnostics" / f"step-{guard.step_count:08d}.rank{guard.rank}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "ts": time.time(),
        "step": guard.step_count,
        "rank": guard.rank,
        "decision_id": command.decision_id,
        "module_grad_norms": guard.module_grad_norms(),
        "recent": [s.to_metrics() for s in guard.recent_stats],
    }
    try:
        out.write_text(json.dumps(payload, indent=1, default=str))
    except OSError as exc:
        raise TransientActionError(f"cannot write diagnostics: {exc}") from exc
    return {"path": str(out), "detail": f"diagnostics in {out.name}"}


@applier("abort")
def abort(guard: ActionTarget, params: dict[str, Any], command: Command) -> dict[str, Any]:
    guard.request_stop(str(params.get("reason") or "aborted by policy"))
    return {"detail": "training loop stopped"}


@applier("replay_step")
def replay_step(guard: ActionTarget, params: dict[str, Any], command: Command) -> dict[str, Any]:
    """Re-run the anomalous step and classify its fault (`workers.replay`); or, as the
    `<decision>-answer` command, take the policy's answer to a replay this rank holds for.

    The one applier that needs more than `ActionTarget`: re-running a step takes the loop
    that ran it, the Guard's (a framework's loop refuses it before this, `refusal`)."""
    from remedy.rank.guard import Guard  # noqa: PLC0415 - the Guard imports the appliers

    if not isinstance(guard, Guard):
        raise ActionError("replay_step needs the Guard's own loop; this one cannot re-run a step")
    if "answer" in params:
        return {"detail": guard.replays.answered(dict(params["answer"]))}
    return replay.replay_step(guard, params, command)
