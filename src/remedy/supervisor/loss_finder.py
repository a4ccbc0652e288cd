"""Finding lost ranks for the supervisor: the hang check's looks carried out, and dead nodes.

`check_hangs` runs in the supervisor's loop while the job is running: when
to ping whom, and whom the answers name hung or dead, is decided by a pure
machine (`control.hang_check.HangCheck`); this module pings, asks the node
agents and looks at the nodes for it. `nodes_lost` journals a node Ray calls
dead with the ranks that ran on it. Each rank found lost is handed to `lost`
(`Recovery.lost`), which steps the run's core with it: where a loss goes is
the core's to decide, not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import ray
import structlog

from remedy.control import hang_check
from remedy.protocol.spec import NAMESPACE
from remedy.supervisor import placement
from remedy.supervisor.agent.actor import agent_name
from remedy.supervisor.step_wait import ranks_text

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from remedy.control.hang_watch import HangWatch
    from remedy.control.run_core import RunCore
    from remedy.control.sightings import Sightings
    from remedy.control.slots import RankSlots
    from remedy.protocol.spec import RunSpec
    from remedy.rundir.writer import RunDir
    from remedy.supervisor.node_watch import DeadNode
    from remedy.supervisor.worker_group import WorkerGroup

log = structlog.get_logger("remedy.recovery")

# How long an agent asked to ping its ranks may take beyond the ping's own timeout.
AGENT_ASK_S = 1.0


class LossFinder:
    """Hung, dead and node-lost ranks of one supervisor's group, found and handed to `lost`."""

    def __init__(
        self,
        group: WorkerGroup,
        *,
        spec: RunSpec,
        run_dir: RunDir,
        slots: RankSlots,
        watch: HangWatch,
        sightings: Sightings,
        core: RunCore,
        check_nodes: Callable[..., Awaitable[None]],
        lost: Callable[..., None],
    ) -> None:
        """`lost(rank, kind, reason, details=..., incarnation=...)`: a rank found lost;
        `check_nodes(group, now=True)`: a look at the nodes before losses are reported."""
        self.group = group
        self.spec = spec
        self.run_dir = run_dir
        self.slots = slots
        self.watch = watch
        self.sightings = sightings
        self.core = core
        self.check_nodes = check_nodes
        self.lost = lost
        # When to ping whom, and whom the answers name (`control.hang_check`).
        self.hang_check = hang_check.HangCheck(
            watch, sightings, slots.incarnations, agents=spec.node_agents == "on"
        )

    async def check_hangs(self) -> None:
        """A look for hung and dead ranks (`HangCheck`): its pings, asks and node checks carried
        out, each answer stepped back in, until the look is over."""
        check = self.hang_check
        effects = check.step(
            hang_check.Look(time.monotonic(), time.time(), tuple(self.group.actors))
        )
        while effects:
            [effect] = effects
            match effect:
                case hang_check.AskAgents(ranks):
                    await self._ask_agents(list(ranks))
                    effects = check.step(hang_check.Asked(time.monotonic()))
                case hang_check.Ping(ranks):
                    cfg = self.watch.config
                    pings = await self.group.ping_all(
                        cfg.ping_timeout_s,
                        None if ranks is None else [r for r in ranks if r in self.group.actors],
                        patience=cfg.ping_patience,
                    )
                    effects = check.step(hang_check.Pinged(pings, time.monotonic()))
                case hang_check.Found(losses):
                    # Their node may be what died: its loss is reported first, for all its
                    # ranks at once, and their own losses are then parts of it (reported once).
                    await self.check_nodes(self.group, now=True)
                    for f in losses:
                        self.lost(f.rank, f.kind, f.reason, details=dict(f.details or {}),
                                  incarnation=f.incarnation)  # fmt: skip
                    effects = check.step(hang_check.Reported())

    async def _ask_agents(self, ranks: list[int]) -> None:
        """The agents of `ranks`' nodes ping their ranks now; their sightings are taken.

        One call per node, all at once, waited for together; an agent that does
        not answer in time (its node lost, say) is logged and left out.
        """
        nodes = {self.slots.slots[r].node for r in ranks if r in self.slots.slots}
        calls: dict[Any, str] = {}
        for node in sorted(n for n in nodes if n):
            with contextlib.suppress(ValueError):
                agent = ray.get_actor(agent_name(self.spec.run_id, node), NAMESPACE)
                calls[asyncio.ensure_future(agent.ping_ranks.remote(self.spec.token))] = node
        if not calls:
            return
        cfg = self.watch.config
        wait_s = AGENT_ASK_S + cfg.ping_timeout_s * max(1.0, cfg.ping_patience)
        done, pending = await asyncio.wait(calls, timeout=wait_s)
        for fut in pending:
            fut.cancel()
            log.warning("agent_did_not_answer", node=calls[fut], waited_s=wait_s)
        for fut in done:
            try:
                items = fut.result()  # done: taken from `done`
            except ray.exceptions.RayError as exc:
                log.warning("agent_did_not_answer", node=calls[fut], error=str(exc)[:200])
                continue
            self.sightings.add(calls[fut][:12], items, time.monotonic())

    def nodes_lost(self, dead: list[DeadNode]) -> None:
        """Nodes Ray calls dead: every rank on them is lost at once, journaled with the node.

        The first of a node's ranks goes to the policy as `node_lost`; the others,
        lost in the same instant, join the restart it decides (`LostRanks`), so one
        restart replaces them all, on the surviving nodes (`WorkerGroup.dead_nodes`).
        """
        for node in dead:
            self.group.node_died(node.node_id)
            # Its ranks not yet replaced, and those found lost on their own in the last
            # `lost_ranks.NODE_LOSS_WINDOW_S` (before Ray's verdict on the node; replaced already, perhaps).
            earlier = self.core.lost.losses.earlier(node.node_id, time.time())
            current = self.slots.on_node(node.node_id, lost_too=True)
            ranks = sorted({*current, *earlier})
            name = placement.label(node.node_id, node.ip)
            reason = (
                f"node {name} is lost: Ray's GCS lists it dead ({node.reason}); "
                f"{ranks_text(set(ranks)) if ranks else 'no rank'} ran on it"
            )
            self.run_dir.history({
                "type": "node_lost", "node": name, "node_id": node.node_id, "ranks": ranks,
                "reason": reason, "detected_at": round(time.time(), 4),
            })  # fmt: skip
            log.warning("node_lost", node=name, ranks=ranks, reason=node.reason)
            for rank in current:  # a replaced rank's new process is elsewhere, and fine
                self.lost(rank, "node_lost", reason, details={
                    "node": name, "node_id": node.node_id, "node_ranks": ranks,
                })  # fmt: skip

    def silent_nodes(self) -> set[str]:
        """Nodes every rank of which was found lost in the last `lost_ranks.NODE_LOSS_WINDOW_S`: what a
        node's death looks like before Ray's verdict on it (a peer's failed collective finds
        its ranks gone in well under a second; the GCS takes its health-check time)."""
        return self.core.lost.losses.silent_nodes(time.time())
