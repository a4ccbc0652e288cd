"""The supervisor's I/O around its run's core: effects carried out, inputs brought back.

The core (`control.run_core.RunCore`) decides; the supervisor actor steps it
and hands what it returns to the `Carrier`, which carries each effect out in
order on the shell's objects (the targeted restart's `Recovery`, the
displays' `Feed`, the gauges, the run directory). The functions below do
the supervisor's I/O with Ray (a rank's run call ending, the ranks of a
restarted supervisor adopted, the peers pinged, the node table read) and
each returns the input it produced, for the actor to step the core with:
nothing here writes the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray
import structlog

from remedy.control import progress_marks, stuck_at
from remedy.control.effects import Notify, log_notify
from remedy.control.hang_watch import DEAD, HangWatch, HangWatchConfig, step_times
from remedy.control.run_core import (
    Answer,
    BatchesLost,
    Dropped,
    Effect,
    Joined,
    NotReplaced,
    OutageNotes,
    RankDied,
    RankEnded,
    RankReturned,
    ReplacementFailed,
    RunCore,
    Status,
    StopAsked,
    Taken,
    ToPolicy,
)
from remedy.control.slots import RankSlots
from remedy.policies import Decision
from remedy.rank.link import liveness
from remedy.rank.loop.metrics import RunMetrics
from remedy.rundir.writer import RunDir
from remedy.supervisor import placement
from remedy.supervisor.feed import Feed
from remedy.supervisor.node_watch import POLL_S as NODE_POLL_S
from remedy.supervisor.node_watch import NodeWatch, verdict_window_s
from remedy.supervisor.notify import Notifier
from remedy.supervisor.recovery import Recovery
from remedy.supervisor.status_view import Pids
from remedy.supervisor.worker_group import WorkerGroup

log = structlog.get_logger("remedy.supervisor")

# What a rank's run call ending, or an adopted rank's answer, brings back.
RankOver = RankDied | RankReturned


class Carrier:
    """Carries out the core's effects, in order, on the shell's objects.

    `recovery` is the targeted restart's shell, set once the control loop
    built the worker group (no rank ends, and no restart starts, before).
    """

    def __init__(
        self,
        core: RunCore,
        feed: Feed,
        metrics: RunMetrics,
        run_dir: RunDir,
        *,
        control: Callable[[], None] = lambda: None,
    ) -> None:
        """`control`: carries out what the controller and the job's state machine asked
        (`carry_control`), first: their journal lines go before the effects' own."""
        self.core = core
        self.feed = feed
        self.metrics = metrics
        self.run_dir = run_dir
        self.control = control
        self.recovery: Recovery | None = None

    def carry(self, effects: list[Effect]) -> None:
        """Carry out what the run's core returned."""
        self.control()
        for effect in effects:
            match effect:
                case Dropped() | ReplacementFailed() | Joined() | ToPolicy() | NotReplaced():
                    assert self.recovery is not None  # ranks end only once the loop built it
                    self.recovery.carry_losses([effect])
                case RankEnded(rank, status):
                    self.feed.set_rank_state(rank, status)
                case BatchesLost(rank, node, count, records):
                    self.run_dir.history({"type": "batches_lost", "rank": rank, "node": node,
                                          "count": count, "records": records})  # fmt: skip
                case OutageNotes(notes):
                    self.outage_notes(notes)
                case Status() | Answer() | Taken() | StopAsked():
                    pass  # read by whoever stepped the core

    def took(self, effects: list[Effect], *, gauges: bool) -> Answer | None:
        """Carry out what the core made of one report (`Report`): the hang watch, a restart
        waiting on the group and the displays see what the controller accepted; returns
        whom to answer. `gauges=False`: an agent's item, whose per-rank gauges its agent set."""
        self.control()
        answer = None
        core, recovery = self.core, self.recovery
        for effect in effects:
            match effect:
                case Taken(rank, tick, report, ending, failed):
                    if ending:
                        core.watch.forget(rank)
                    if failed and recovery is not None:
                        recovery.alarm(rank)
                    valid = report.as_batch()
                    self.feed.observe(valid)
                    if gauges:
                        self.metrics.observe(valid)
                    self.metrics.goodput(core.controller.goodput, core.started)
                    core.watch.beat(rank, tick, time.monotonic(), step_times(report.metrics))
                    if recovery is not None:
                        recovery.progress(rank, tick)
                case Answer():
                    answer = effect
                case _:
                    self.carry([effect])
        self.feed.decisions(core.controller.decisions)
        self.metrics.decisions(core.controller.decisions)
        return answer

    def outage_notes(self, notes: Any) -> None:
        """Journal the outages a rank or the driver saw end (untrusted: each note is checked)."""
        for raw in notes[: liveness.MAX_NOTES] if isinstance(notes, list) else [notes]:
            note = liveness.valid_note(raw)
            if note is None:
                self.core.controller.rejected["outage_note"] += 1
                continue
            self.run_dir.history({"type": "supervisor_outage", "note": note})
            log.warning("supervisor_outage", **note)


def group_action(recovery: Recovery | None, d: Decision) -> tuple[str, str] | None:
    """restart_rank: replace the decision's ranks asynchronously (resolved when done)."""
    if d.action != "restart_rank":
        return "failed", f"{d.action} is not a group action"
    if recovery is None:
        return "failed", "restart_rank needs a running worker group; none is attached"
    recovery.start(d)
    return None


def notify(notifier: Notifier, pids: Pids, effect: Notify) -> tuple[str, str]:
    """A notify effect: logged, and queued for every sink; returns at once."""
    outcome, detail = log_notify(effect)
    d = effect.decision
    if d is None:
        return outcome, detail
    nodes = {r: pids[r][0] for r in d.ranks if r in pids}
    if d.anomaly.node is not None:
        # Where the fault was seen: the rank may have been replaced elsewhere since.
        nodes[d.anomaly.rank] = d.anomaly.node
    sent = notifier.submit(d, nodes)
    return outcome, f"{detail}; {sent}" if sent else detail


async def node_verdicts(
    recovery: Recovery,
    node_watch: NodeWatch,
    group: WorkerGroup,
    check_nodes: Callable[..., Awaitable[None]],
) -> None:
    """The run ended soon after a node's ranks were all found lost: wait for Ray's
    verdict on that node, at most its health-check time (`node_watch.verdict_window_s`),
    so the journal says whether the node was lost (`node_lost`) and why.

    A peer's failed collective finds a dead node's ranks gone and has them
    replaced within a second; Ray's GCS calls the node dead after its
    health checks fail (1.5 s on the test clusters, 15 s or more with Ray's
    defaults), and a run that ends first would not say so otherwise.
    """
    if len(group.cluster) <= 1:
        return
    waiting = recovery.silent_nodes() - node_watch.reported
    if not waiting:
        return
    window = verdict_window_s()
    deadline = time.monotonic() + window
    while waiting and time.monotonic() < deadline:
        await check_nodes(group, now=True)
        waiting -= node_watch.reported
        if waiting:
            await asyncio.sleep(NODE_POLL_S)
    if waiting:
        log.info("node_verdict_not_given", nodes=sorted(waiting), waited_s=round(window, 1))


async def peers_at(group: WorkerGroup, rank: int, config: HangWatchConfig) -> dict[str, int]:
    """Where the peers of `rank`, which died, wait (`control.stuck_at.front` of one ping
    round): the step its loss is recorded at, which its last report lags."""
    peers = [r for r in group.actors if r != rank]
    if not peers:
        return {}
    pings = await group.ping_all(config.ping_timeout_s, ranks=peers,
                                 patience=config.ping_patience)  # fmt: skip
    where = stuck_at.front(pings)
    return {} if where is None else {"step": where[0], "tick": where[1]}


async def rank_finished(
    group: WorkerGroup,
    ref: ray.ObjectRef,
    slots: RankSlots,
    config: HangWatchConfig,
    check_nodes: Callable[..., Awaitable[None]],
) -> RankOver | None:
    """A rank's run call ended (`ref`): its result, or its process's death; None where
    there is nothing to step (remedy killed it to replace it, or it is only unreachable)."""
    rank, incarnation = group.owner(ref)
    retired = group.retired(ref)
    group.forget(ref)
    try:
        result = await ref
    except ray.exceptions.RayError as exc:
        if retired:
            return None  # remedy killed this process itself to replace it
        if isinstance(exc, ray.exceptions.ActorUnavailableError):
            # Not known to be dead (`supervisor.pings`): its end is learnt from `result`
            # calls, as an adopted rank's, and the hang watch judges its silence.
            if incarnation == slots.incarnation(rank):
                log.warning("rank_unreachable", rank=rank, error=str(exc)[:200])
                group.follow(rank)
            return None
        # Its node may be what died: then the node's loss is what is reported (for all its
        # ranks at once), and this rank's own loss is a part of it. While that look is out,
        # a restart may replace this rank (its node found lost meanwhile): the loss below
        # is about the incarnation that ran here, and dropped if that one is replaced.
        await check_nodes(group, now=True)
        at = await peers_at(group, rank, config)
        return RankDied(
            rank, incarnation, f"rank process died: {exc}",
            f"rank {rank}'s process died ({why_gone(exc)})", time.time(),
            {"error": str(exc)[:300], "incarnation": incarnation, **at},
        )  # fmt: skip
    return RankReturned(rank, incarnation, result)


def adopted_result(
    group: WorkerGroup | None, slots: RankSlots, rank: int, result: Any
) -> RankOver | None:
    """An adopted rank ended (its summary) or is gone (`DEAD`); or one this supervisor
    started and follows the same way (`WorkerGroup.follow`)."""
    followed = group is not None and rank in group.followed
    promoted = group is not None and rank in group.promoted
    if group is not None:
        group.followed.discard(rank)
        group.promoted.discard(rank)
    if result == DEAD:
        when = (
            "(a spare its node's agent started)" if promoted
            else "after its run call lost touch" if followed
            else "while the supervisor was away"
        )  # fmt: skip
        return RankDied(
            rank, slots.incarnation(rank), f"rank process died {when}",
            f"rank {rank}'s process is gone", time.time(),
        )  # fmt: skip
    incarnation = result.get("incarnation")
    return RankReturned(rank, incarnation, result) if type(incarnation) is int else None


async def watch_from_marks(group: WorkerGroup, watch: HangWatch) -> None:
    """Back after a restart: each rank's stall judged from its own progress mark (one ping
    round, `control.progress_marks`), so a rank that hung while no supervisor watched is
    found within its usual timeout, not after a start-up allowance."""
    config = watch.config
    pings = await group.ping_all(config.ping_timeout_s, patience=config.ping_patience)
    for rank, mark in progress_marks.marks(pings, wall=time.time(), now=time.monotonic()).items():
        watch.marked(rank, mark.tick, mark.since, mark.ran)


def keep_output(run_dir: RunDir, lines: Any) -> None:
    """Lines the ranks printed (untrusted: only well-formed ones), into the run directory."""
    kept = [
        {k: x.get(k) for k in ("ts", "rank", "stream", "line")}
        for x in lines if isinstance(x, dict) and isinstance(x.get("line"), str)
    ] if isinstance(lines, list) else []  # fmt: skip
    try:
        run_dir.output(kept)
    except OSError as exc:  # a full disk loses the copy, never the run
        log.warning("output_not_written", error=str(exc))


def kill_node_verdict(rank: int, node_id: str, on_node: list[int]) -> dict[str, Any]:
    """Chaos (`kill_node`): may `rank` kill its node `node_id`? The journal record saying so.

    Never the node this supervisor runs on, nor the cluster's head node: the
    fault takes a worker node away, as a real node loss does.
    """
    home = ray.get_runtime_context().get_node_id()
    listing = {str(n.get("NodeID")): n for n in ray.nodes()}
    node = listing.get(node_id, {})
    name = placement.label(node_id, node.get("NodeManagerAddress"))
    reason = f"rank {rank} asked to kill its node {name}"
    if node_id == home:
        kill, reason = False, f"{reason}: refused, the supervisor runs on that node"
    elif "node:__internal_head__" in (node.get("Resources") or {}):
        kill, reason = False, f"{reason}: refused, it is the cluster's head node"
    else:
        kill = True
    return {
        "type": "chaos_kill_node", "rank": rank, "node": name, "node_id": node_id,
        "ranks": on_node, "outcome": "killing" if kill else "refused",
        "reason": reason, "at": round(time.time(), 4),
    }  # fmt: skip


def exit_later(linger_s: float) -> None:
    """Remove this detached actor `linger_s` from now (no restart)."""

    def leave() -> None:
        with contextlib.suppress(Exception):
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    asyncio.get_running_loop().call_later(linger_s, leave)


def why_gone(exc: ray.exceptions.RayError) -> str:
    """A rank process's end in a few words: the error's type and the line of Ray's text that
    says why (its node died, it was killed, ...), else its first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = next((line for line in lines if line.startswith("The actor died because")), None)
    return f"{type(exc).__name__}: {(why or (lines[0] if lines else ''))[:160]}"
