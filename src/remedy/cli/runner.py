"""The driver side of `remedy run` and `remedy attach`: start or join a supervisor, show its
progress, return the summary.

The supervisor is a named, detached actor (`launch_supervisor`), so whoever
watches a run only polls it: `wait(timeout_s)` for the end, `events` for the
display. A driver that started the run and sees it end removes the actor.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import structlog

from remedy.cli.cluster import private_ray_gone
from remedy.cli.display import Display
from remedy.protocol.exceptions import SupervisorLost, WaitTimeout
from remedy.protocol.spec import RunSpec
from remedy.rank.link import liveness
from remedy.rundir.headline import steps_words
from remedy.supervisor import waits
from remedy.supervisor.actor import launch_supervisor
from remedy.supervisor.worker_group import kill_run_actors

# How long a call that asks the supervisor for something (status, events) may take.
ANSWER_S = 30.0
# The Guard's default heartbeat: the driver's silence bound derives from it.
HEARTBEAT_S = 0.5
log = structlog.get_logger("remedy.runner")

PROGRESS_EVERY_S = 5.0
# How often a display polls the supervisor's feed.
POLL_S = 0.5
# How long a stopping run may take to write its final checkpoint and end.
STOP_TIMEOUT_S = 120.0
# How long a new supervisor may take to start (its process, its policy, its journal).
START_S = 120.0


def run_supervised(
    spec: RunSpec,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    display: Display | None = None,
) -> dict[str, Any]:
    """Run `spec` under a supervisor actor on the connected Ray cluster; block until it ends.

    `display` gets every feed event (the ranks' output, anomalies, decisions,
    progress) as it happens; `progress`, the supervisor's status every
    `PROGRESS_EVERY_S`. On KeyboardInterrupt the run is stopped cleanly
    (`stop_run`) before the interrupt goes on up.
    """
    sup = launch_supervisor(spec)
    summary: dict[str, Any] | None = None
    try:
        waits.get(sup.start.remote(), START_S, "the supervisor's start")
        try:
            summary = follow(
                sup,
                spec.token,
                display=display,
                progress=progress,
                silence_s=spec.supervisor_timeout_s,
            )
            return summary
        except ray.exceptions.RayActorError:
            # The run ended while this driver was not looking (stopped, say) and its
            # supervisor has left since: the run directory holds how it ended.
            summary = _written_summary(spec)
            if summary is None:
                raise
            return summary
        except KeyboardInterrupt:
            summary = stop_run(sup, spec.token, "interrupted (Ctrl-C or SIGTERM of remedy run)")
            raise
    finally:
        # The supervisor is detached (it outlives a crash of its own); a run that is
        # not detached ends with its driver: the supervisor, and the ranks if it had
        # no time to kill them itself.
        ray.kill(sup, no_restart=True)
        if summary is None:
            kill_run_actors(spec.run_id)


def _written_summary(spec: RunSpec) -> dict[str, Any] | None:
    """summary.json of `spec`'s run, if its supervisor wrote one."""
    try:
        summary = json.loads((Path(spec.run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("run_id") == spec.run_id else None


def follow(
    supervisor: Any,
    token: str,
    *,
    display: Display | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    cursor: int = 0,
    silence_s: float | None = None,
) -> dict[str, Any]:
    """Poll a started supervisor until its run ends; the summary.

    Every call is bounded. A supervisor that answers nothing for the silence
    bound is hung: it is killed so that Ray restarts it (`supervisor.liveness`),
    the display says so, and the outage is noted to it once it answers again.
    One that is not back `liveness.RESTART_S` after that raises `SupervisorLost`.
    """
    watch = liveness.SilenceWatch("driver", liveness.silence_bound(HEARTBEAT_S, silence_s))
    ident = _identity(supervisor)
    last_status = time.monotonic()
    while True:
        wait_s = POLL_S if display else PROGRESS_EVERY_S
        asked = time.time()
        try:
            summary = waits.get(
                supervisor.wait.remote(wait_s), wait_s + watch.bound_s, "the supervisor's wait"
            )
            if display is not None:
                cursor = pump(supervisor, display, cursor, token)
            if progress is not None and time.monotonic() - last_status >= PROGRESS_EVERY_S:
                last_status = time.monotonic()
                progress(waits.get(supervisor.status.remote(token), ANSWER_S, "status"))
        except WaitTimeout:
            if private_ray_gone() is not None:
                raise  # nothing will answer again: the caller says the cluster went away
            action = watch.check(asked + wait_s)  # the answer was due then
            if action == "kill":
                watch.killed(
                    liveness.kill(
                        ident, supervisor, here=ray.util.get_node_ip_address(), may_ray_kill=True
                    )
                )
            elif action == "give_up":
                raise SupervisorLost(str(watch.gave_up)) from None
            if display is not None and watch.outage is not None:
                display.handle({
                    "event": "supervisor_silent",
                    "seconds": round(time.time() - watch.outage.began, 1),
                    "how": watch.outage.how,
                })  # fmt: skip
            continue
        if watch.outage is not None:
            watch.answered(asked)
            ident = _identity(supervisor)  # restarted: another process
        for note in watch.take_notes():
            if display is not None:
                display.handle({"event": "supervisor_back", **note})
            ended = waits.get(supervisor.note_outage.remote(token, note), ANSWER_S, "note_outage")
            if summary is not None and ended is not None:
                summary = ended  # the run ended before the note: its summary has it now
        if summary is not None:
            return dict(summary)


def _identity(supervisor: Any) -> liveness.Identity | None:
    """Which process the supervisor is now (None if it does not say within `ANSWER_S`)."""
    try:
        return liveness.Identity.from_wire(
            waits.get(supervisor.where.remote(), ANSWER_S, "the supervisor's address")
        )
    except WaitTimeout:
        return None


def stop_run(
    supervisor: Any, token: str, reason: str, *, timeout_s: float = STOP_TIMEOUT_S
) -> dict[str, Any] | None:
    """Ask for a clean stop (final checkpoint, then the end) and wait for it; the summary, or
    None if the run did not end within `timeout_s` (a second Ctrl-C also gives up)."""
    try:
        ray.get(supervisor.stop.remote(token, reason), timeout=30)
        summary = ray.get(supervisor.wait.remote(timeout_s), timeout=timeout_s + 30)
    except (KeyboardInterrupt, ray.exceptions.RayError, TimeoutError):
        return None
    return dict(summary) if summary is not None else None


def pump(supervisor: Any, display: Display, cursor: int, token: str) -> int:
    """Hand the supervisor's new feed events to `display`; return the next cursor."""
    events, after = waits.get(supervisor.events.remote(cursor, token), ANSWER_S, "events")
    if after < cursor:  # a restarted supervisor's feed starts again from 0
        events, after = waits.get(supervisor.events.remote(0, token), ANSWER_S, "events")
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
            f"run {summary['run_id']}: {summary['status']} ({steps_words(summary)}, "
            f"goodput {summary['goodput']:.1%}, {summary['wall_s']:.1f}s)"
        ),
    ]
    lines.extend(goodput_lines(summary))
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
    if summary.get("degraded_reason"):
        lines.append(f"degraded: {summary['degraded_reason']}")
    for rank in summary.get("ranks") or []:
        for fault in (rank.get("chaos_not_reached") or []) if isinstance(rank, dict) else []:
            lines.append(f"warning: chaos fault {fault}")
    return "\n".join(lines)


def goodput_lines(summary: dict[str, Any]) -> list[str]:
    """Step goodput, ETTR and the time lost by cause, in words (none for an older summary)."""
    if "steps_kept" not in summary:
        return []
    ettr = summary.get("ettr")
    line = f"goodput: {summary['steps_kept']}/{summary['steps_executed']} steps kept" + (
        f", ETTR {ettr:.1%} ({summary.get('time_kept_s', 0):.1f}s of kept steps)" if ettr else ""
    )
    out = [line]
    for r in summary.get("time_lost") or []:
        if r.get("cause") is None:
            continue
        steps = f"{r['steps']} step(s), " if r.get("steps") else ""
        out.append(
            f"  lost to {r['cause']}: {steps}{r['seconds']:.2f}s {r['what'].replace('_', ' ')}"
        )
    return out
