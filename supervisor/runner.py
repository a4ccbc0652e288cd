"""The driver side of `remedy run`: start the supervisor, show progress, return the summary."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import ray

from remedy.supervisor.actor import launch_supervisor
from remedy.supervisor.display import Display
from remedy.supervisor.spec import RunSpec
from remedy.supervisor.worker_group import kill_run_actors

PROGRESS_EVERY_S = 5.0
# How often a display polls the supervisor's feed.
POLL_S = 0.5


def run_supervised(
    spec: RunSpec,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    display: Display | None = None,
) -> dict[str, Any]:
    """Run `spec` under a supervisor actor on the connected Ray cluster; block until it ends.

    `display` gets every feed event (the ranks' output, anomalies, decisions,
    progress) as it happens; `progress`, the supervisor's status every
    `PROGRESS_EVERY_S`.
    """
    sup = launch_supervisor(spec)
    ray.get(sup.start.remote())
    cursor = 0
    last_status = time.monotonic()
    summary: dict[str, Any] | None = None
    try:
        while True:
            summary = ray.get(sup.wait.remote(POLL_S if display else PROGRESS_EVERY_S))
            if display is not None:
                cursor = pump(sup, display, cursor)
            if summary is not None:
                return dict(summary)
            if progress is not None and time.monotonic() - last_status >= PROGRESS_EVERY_S:
                last_status = time.monotonic()
                progress(ray.get(sup.status.remote()))
    finally:
        # The supervisor is detached (it outlives a crash of its own); a run that is
        # not detached ends with its driver: the supervisor, and the ranks if it had
        # no time to kill them itself.
        ray.kill(sup, no_restart=True)
        if summary is None:
            kill_run_actors(spec.run_id)


def pump(supervisor: Any, display: Display, cursor: int) -> int:
    """Hand the supervisor's new feed events to `display`; return the next cursor."""
    events, after = ray.get(supervisor.events.remote(cursor))
    if after < cursor:  # a restarted supervisor's feed starts again from 0
        events, after = ray.get(supervisor.events.remote(0))
    cursor = after
    for event in events:
        display.handle(event)
    return int(cursor)


def print_progress(status: dict[str, Any]) -> None:
    step = max(status["step"].values(), default=0)
    loss = status["loss"]
    loss_s = f"{loss:.3f}" if isinstance(loss, float) else "-"
    acts = ", ".join(f"{k}×{v}" for k, v in sorted(status["actions"].items())) or "none"
    print(
        f"[{status['wall_s']:6.1f}s] step {step:>6}  loss {loss_s}  actions: {acts}",
        file=sys.stderr,
    )


def format_summary(summary: dict[str, Any], decisions: list[dict[str, Any]]) -> str:
    """A short human summary: what was detected, what was done, how it ended."""
    lines = [
        (
            f"run {summary['run_id']}: {summary['status']} "
            f"({summary['steps_completed']} steps, {summary['steps_executed']} executed, "
            f"goodput {summary['goodput']:.1%}, {summary['wall_s']:.1f}s)"
        ),
    ]
    if summary.get("final_loss") is not None:
        lines.append(f"final loss {summary['final_loss']:.4f}")
    anomalies = summary.get("anomalies") or {}
    lines.append(
        "anomalies: " + (", ".join(f"{k}×{v}" for k, v in sorted(anomalies.items())) or "none")
    )
    # Journal lines are written when outcomes arrive; read them in decision order.
    for d in sorted(decisions, key=lambda d: str(d.get("decision_id", ""))):
        lines.append(
            f"  [{d['outcome']:>10}] step {d['step']:>5} {d['rule']}: {d['action']} — {d['reason']}"
        )
        if d.get("detail"):
            lines.append(f"               {d['detail']}")
    if summary.get("abort_reason"):
        lines.append(f"aborted: {summary['abort_reason']}")
    return "\n".join(lines)
